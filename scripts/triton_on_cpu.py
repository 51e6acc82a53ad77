"""The GPU code path end to end on a machine without a GPU: the Triton kernels, run by Triton's
interpreter on CPU tensors, against the C++ CPU kernels, in three runs a GPU user makes.

    python scripts/triton_on_cpu.py [--tokens 24]

1. The report's decode protocol: SmolLM2 fed the default text one token at a time through RKVCache at
   rkv-4 (its 128-token key blocks and 64-token window cut to 16 and 8, so a short text reads
   quantized rows): the perplexity through each implementation, equal to 1e-4 relative.
2. A PagedQuantizedKVCache with ragged sequences joining, forking and leaving, and chunked prefill (the
   ops the vLLM plugin calls): every attention output within 1e-4 of its scale of the CPU kernels',
   and every byte of the pages and side slots equal (the appends are bit for bit).
3. A decode step under torch.compile(fullgraph=True) through the Triton kernels: equal to eager.

Within `torch_rkv.gpu.registry.on_cpu()` every rkv op with a Triton kernel takes CPU tensors there, as
TORCH_RKV_TRITON_ON_CPU=1 does for a whole process. Exit status 1 when a run disagrees.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ["TRITON_INTERPRET"] = "1"  # the kernels run interpreted (read when they are imported)

import torch  # noqa: E402

import torch_rkv  # noqa: E402
from torch_rkv import scheme as S  # noqa: E402
from torch_rkv.gpu import registry  # noqa: E402
from torch_rkv.ops.structs import AttentionOptions  # noqa: E402
from torch_rkv.paged import PagedQuantizedKVCache  # noqa: E402

SCALE_TOLERANCE = 1e-4  # attention outputs: |triton - cpu| <= 1e-4 * max |cpu|
PPL_TOLERANCE = 1e-4  # relative


def decode_protocol(tokens: int) -> tuple[bool, str]:
    from torch_rkv.eval import data, perplexity
    from torch_rkv.integrations.transformers import RKVCache

    model, tok = data.load_model()
    ids = data.encode(tok, data.read_text())[:, :tokens]
    scheme = S.by_name("rkv-4").replace(k_block_tokens=16, recent=8)
    ppl = {}
    for name, ctx in (("cpu", _Nothing()), ("triton", registry.on_cpu())):
        with ctx, torch.no_grad():
            ppl[name] = perplexity.decoded(model, ids, lambda n: RKVCache(model, scheme, capacity=n))
    rel = abs(ppl["triton"] / ppl["cpu"] - 1)
    return rel <= PPL_TOLERANCE, (f"decode protocol, {ids.shape[1]} tokens, {scheme.name} (block 16, recent 8): "
                                  f"perplexity C++ {ppl['cpu']:.6f}, Triton {ppl['triton']:.6f}, relative "
                                  f"difference {rel:.2e} (bound {PPL_TOLERANCE:g})")


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _paged_run(scheme, triton: bool) -> tuple[list[torch.Tensor], PagedQuantizedKVCache]:
    """One fixed schedule: sequences join, prefill in chunks, decode, fork and leave; every output."""
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 8, 2, 64
    cos, sin = torch_rkv.rope_tables(dim, 512, theta=1e4)
    cache = PagedQuantizedKVCache(scheme, 1, kv_heads, dim, 48, 6, page_size=32, dtype=torch.float32,
                                  rope=(cos, sin), max_pages_per_seq=8)
    outs = []
    ctx = registry.on_cpu() if triton else _Nothing()
    with ctx, torch.no_grad():
        seqs = [cache.add(), cache.add()]
        plan = [([0, 1], [21, 5]), ([0, 1], [1, 30]), ("add", None), ([0, 1, 2], [1, 1, 17]), ("fork", 1),
                ([0, 1, 2, 3], [1, 2, 1, 1]), ("remove", 0), ([1, 2, 3], [9, 1, 1]), ([1, 2, 3], [1, 1, 40])]
        for step, counts in plan:
            if step == "add":
                seqs.append(cache.add())
                continue
            if step == "fork":
                seqs.append(cache.fork(seqs[counts]))
                continue
            if step == "remove":
                cache.remove(seqs[counts])
                continue
            ids = [seqs[i] for i in step]
            batch = cache.schedule(ids, counts)
            t = sum(counts)
            q = torch.randn(t, heads, dim, generator=gen)
            k = torch.randn(t, kv_heads, dim, generator=gen)
            v = torch.randn(t, kv_heads, dim, generator=gen)
            outs.append(cache.prefill(0, batch, q, k, v))
            cache.commit(batch)
            decode = cache.schedule(ids, [0] * len(ids))
            outs.append(cache.attend(0, decode, torch.randn(len(ids), heads, dim, generator=gen)))
    return outs, cache


def paged_cache() -> tuple[bool, str]:
    scheme = S.by_name("rkv-4").replace(k_block_tokens=8, recent=8)
    want, c_cpu = _paged_run(scheme, False)
    got, c_tri = _paged_run(scheme, True)
    worst = max(((g - w).abs().max() / w.abs().max().clamp_min(1e-30)).item() for g, w in zip(got, want))
    same = all(torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                           b.view(torch.uint8) if b.is_floating_point() else b)
               for a, b in zip(_state(c_cpu), _state(c_tri)))
    ok = worst <= SCALE_TOLERANCE and same
    return ok, (f"paged cache, {len(want)} prefill and decode calls: largest difference {worst:.2e} of the output "
                f"scale (bound {SCALE_TOLERANCE:g}); pages, side slots and page fill {'equal' if same else 'DIFFER'}")


def _state(cache: PagedQuantizedKVCache) -> list[torch.Tensor]:
    return [t for t in cache.layer_tensors(0) if t is not None] + [cache.page_fill[0]]


def compiled_step() -> tuple[bool, str]:
    torch._dynamo.reset()
    scheme = S.by_name("rkv-4").replace(k_block_tokens=16, recent=8)
    dim, kv_heads, heads = 64, 2, 8
    cos, sin = torch_rkv.rope_tables(dim, 256, theta=1e4)
    cache = PagedQuantizedKVCache(scheme, 1, kv_heads, dim, 16, 2, page_size=32, dtype=torch.float32,
                                  rope=(cos, sin), max_pages_per_seq=4)
    gen = torch.Generator().manual_seed(1)
    with registry.on_cpu(), torch.no_grad():
        seqs = [cache.add(), cache.add()]
        batch = cache.schedule(seqs, [40, 23])
        cache.prefill(0, batch, torch.randn(63, heads, dim, generator=gen), torch.randn(63, kv_heads, dim, generator=gen),
                      torch.randn(63, kv_heads, dim, generator=gen))
        cache.commit(batch)
        step = cache.schedule(seqs, [0, 0])
        q = torch.randn(2, heads, dim, generator=gen)

        def attend(q, tables, slots, lengths):
            return torch_rkv.ops.paged.paged_decode_attention(
                q, *cache.sides(0), scheme.format, AttentionOptions(cache.rope_cos, cache.rope_sin), lengths=lengths,
                block_tables=tables, side_slots=slots)

        eager = attend(q, step.block_tables, step.side_slots, step.lengths)
        compiled = torch.compile(attend, fullgraph=True)(q, step.block_tables, step.side_slots, step.lengths)
    ok = torch.equal(eager, compiled)
    return ok, f"torch.compile(fullgraph=True) decode step through the Triton kernels: {'equal to' if ok else 'DIFFERS from'} eager"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    failed = 0
    for run in (lambda: paged_cache(), lambda: compiled_step(), lambda: decode_protocol(args.tokens)):
        start = time.time()
        ok, line = run()
        print(f"{'ok' if ok else 'FAIL'}  {line} ({time.time() - start:.0f} s)", flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
