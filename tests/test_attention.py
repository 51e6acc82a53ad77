"""rkv::decode_attention: equal to reference attention over the dequantized cache; accuracy against
unquantized attention; pre-RoPE and Hadamard storage; split-K; compile; bad input."""

import re

import pytest
import torch
from cachebuild import (
    attention_fp32,
    buffers_args,
    build,
    case_levels,
    float_tolerance,
    meta_dtypes,
    outliers_args,
    quantization_bound,
    sides,
)
from conftest import device_params
from hypothesis import given
from hypothesis import strategies as st

import torch_rkv
from torch_rkv import reference as ref
from torch_rkv.ops.structs import AttentionOptions, split_sides
from torch_rkv.scheme import Scheme

DEVICES = device_params("decode_attention")


@st.composite
def attention_cases(draw):
    d = draw(st.sampled_from([64, 96, 128, 256, 512]))  # 96 and 512: the CPU kernel's generic (not unrolled) head
    # dims; 512 also the CUDA kernel's widest lanes (Gemma 4's global layers)
    kv_heads = draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([1, 3, 4]))
    k_kind = draw(st.sampled_from(["token", "grouped", "channel"]))
    block = draw(st.sampled_from([4, 16, 32]))
    k_group, k_tokens = {"token": (None, 1), "grouped": (32, 1), "channel": (1, block)}[k_kind]
    key_space = draw(st.sampled_from(["post", "pre", "hadamard"]))
    scheme = Scheme(
        k_bits=draw(st.sampled_from([2, 3, 4, 8])), v_bits=draw(st.sampled_from([2, 3, 4, 8])),
        k_group_size=k_group, k_block_tokens=k_tokens, v_group_size=draw(st.sampled_from([g for g in (None, 16, 32, 64) if g is None or d % g == 0])),
        v_block_tokens=1, k_symmetric=draw(st.booleans()), v_symmetric=draw(st.booleans()),
        pre_rope=key_space == "pre", k_hadamard=key_space == "hadamard", v_hadamard=draw(st.booleans()),
        sinks=draw(st.sampled_from([0, 1, 4])), recent=draw(st.sampled_from([0, 8])),
        **meta_dtypes(draw),
        outliers=draw(st.sampled_from([0.0, 0.0, 0.02])),  # sparse outliers in both sides' blocks
    )
    batch = draw(st.integers(1, 3))
    cap = draw(st.sampled_from([40, 100]))
    edges = [0, 1, scheme.sinks, scheme.sinks + scheme.recent + scheme.block - 1,
             scheme.sinks + scheme.recent + scheme.block, cap]
    lengths = [draw(st.sampled_from(edges + [draw(st.integers(0, cap))])) for _ in range(batch)]
    return dict(
        d=d, kv_heads=kv_heads, q_heads=kv_heads * ratio, scheme=scheme, capacity=cap, lengths=lengths,
        rot=draw(st.sampled_from([d, d // 2])), interleaved=draw(st.booleans()),
        q_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        fp_dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        split=draw(st.sampled_from([0, 7, 32])), seed=draw(st.integers(0, 2**16)),
        # a sliding window (the buffers a ring of its rows; windows shorter than recent + block too) and
        # Gemma 2's soft-capping
        window=draw(st.sampled_from([0, 0, 1, 5, 17, 33])), softcap=draw(st.sampled_from([0.0, 0.0, 0.5, 4.0])),
        levels=draw(st.booleans()),  # non-uniform codebooks on the asymmetric sides below 8 bits
        # learned attention sinks (GPT-OSS): one logit per query head, of this spread (None: none)
        sink_spread=draw(st.sampled_from([None, None, 0.0, 3.0])),
    )


def case_sink_logits(case, device="cpu"):
    """The case's learned attention sinks (q_heads,) or None: normal logits of spread sink_spread."""
    spread = case.get("sink_spread")
    if spread is None:
        return None
    return (torch.randn(case["q_heads"], generator=torch.Generator().manual_seed(case["seed"] + 1)) * spread).to(device)


def run_kernel(case, device, bufs, q, rope, k_signs, v_signs, split=None):
    s = case["scheme"]
    lengths = torch.tensor(case["lengths"], device=device)
    opts = AttentionOptions(rope[0], rope[1], case["interleaved"], k_signs, v_signs,
                            sliding_window=case.get("window", 0), softcap=case.get("softcap", 0.0),
                            sink_logits=case_sink_logits(case, device))
    return torch_rkv.decode_attention(q, *sides(bufs, case_levels(case, device)), lengths, s.format, opts,
                                      split_tokens=case["split"] if split is None else split)


def run_reference(case, bufs, q, rope, k_signs, v_signs):
    s = case["scheme"]
    cpu = lambda t: None if t is None else t.cpu()  # noqa: E731
    return ref.decode_attention(
        q.cpu(), *[cpu(t) for t in buffers_args(bufs)], torch.tensor(case["lengths"]), s.k_bits, s.v_bits, s.block,
        s.recent, cpu(rope[0]), cpu(rope[1]), case["interleaved"], cpu(k_signs), cpu(v_signs),
        sliding_window=case.get("window", 0), softcap=case.get("softcap", 0.0), k_levels=case_levels(case)[0],
        v_levels=case_levels(case)[1], **{k: cpu(t) for k, t in outliers_args(bufs).items()},
        sink_logits=case_sink_logits(case))


@pytest.mark.parametrize("device", DEVICES)
@given(case=attention_cases())
def test_matches_reference_over_the_dequantized_cache(device, case):
    layout, bufs, q, keys, values, rope, k_signs, v_signs = build(case, device)
    got = run_kernel(case, device, bufs, q, rope, k_signs, v_signs)
    want = run_reference(case, bufs, q, rope, k_signs, v_signs)
    assert got.dtype == q.dtype and got.shape == q.shape
    tol = float_tolerance(q, keys, values, q.dtype)
    assert (got.cpu().float() - want.float()).abs().max().item() <= tol
    for b, n in enumerate(case["lengths"]):
        if n == 0:
            assert torch.equal(got[b].cpu(), torch.zeros_like(got[b].cpu()))


@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("bits, levels, outliers", [((3, 4), False, 0.0), ((3, 4), True, 0.0), ((4, 2), True, 0.0),
                                                    ((2, 2), False, 0.02)])
def test_every_cpu_level_matches_the_reference(d, bits, levels, outliers):
    """The portable and the AVX2 kernels (every level this CPU runs, switched in one process) each equal
    the reference to float tolerance, for an unrolled and a generic head dim, with uniform codes and with
    codebooks (AVX2 looks codes up in registers: one permute up to 8 levels, two and a blend for 16)."""
    s = Scheme(k_bits=bits[0], v_bits=bits[1], k_group_size=1, k_block_tokens=16, v_group_size=32, pre_rope=True,
               v_hadamard=True, sinks=2, recent=8, meta_dtype=torch.bfloat16, outliers=outliers)
    case = dict(d=d, kv_heads=2, q_heads=6, scheme=s, capacity=100, lengths=[100, 37], rot=d, interleaved=False,
                q_dtype=torch.float32, fp_dtype=torch.bfloat16, split=32, seed=3, levels=levels)
    _, bufs, q, keys, values, rope, ks, vs = build(case)
    want = run_reference(case, bufs, q, rope, ks, vs)
    chosen = torch_rkv.cpu_capability()
    try:
        for level in torch_rkv._C.cpu_capabilities():
            torch_rkv._C._set_cpu_capability(level)
            assert torch_rkv.cpu_capability() == level
            got = run_kernel(case, "cpu", bufs, q, rope, ks, vs)
            assert (got - want).abs().max().item() <= float_tolerance(q, keys, values, torch.float32), level
    finally:
        torch_rkv._C._set_cpu_capability(chosen)
    with pytest.raises(ValueError, match="avx9000 is not a CPU level"):
        torch_rkv._C._set_cpu_capability("avx9000")


def scheme_at(bits: int, **kw) -> Scheme:
    return Scheme(k_bits=bits, v_bits=bits, **kw)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_space", ["post", "pre", "hadamard"])
def test_error_against_unquantized_attention_shrinks_with_bits(device, key_space):
    errs = {}
    for bits in (2, 3, 4, 8):
        s = scheme_at(bits, k_group_size=1, k_block_tokens=32, v_group_size=32, pre_rope=key_space == "pre",
                      k_hadamard=key_space == "hadamard", v_hadamard=key_space == "hadamard",
                      meta_dtype=torch.float32)
        case = dict(d=128, kv_heads=2, q_heads=8, scheme=s, capacity=512, lengths=[512, 300], rot=128,
                    interleaved=False, q_dtype=torch.float32, fp_dtype=torch.float32, split=0, seed=7)
        _, bufs, q, keys, values, rope, ks, vs = build(case, device)
        got = run_kernel(case, device, bufs, q, rope, ks, vs).cpu()
        want = attention_fp32(q.cpu(), keys, values, case["lengths"])
        errs[bits] = ((got - want).norm() / want.norm()).item()
        assert (got - want).abs().max().item() <= quantization_bound(q, bufs, values, v_rotated=key_space == "hadamard")
    assert errs[2] > errs[3] > errs[4] > errs[8]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("key_space", ["pre", "hadamard"])
def test_unquantized_storage_reproduces_plain_attention(device, key_space):
    """With every token in the full-precision window (recent >= n), pre-RoPE keys rotated in the kernel
    and Hadamard-rotated keys/values give plain attention on the original K/V to float tolerance."""
    s = Scheme(k_bits=4, v_bits=4, pre_rope=key_space == "pre", k_hadamard=key_space == "hadamard",
               v_hadamard=key_space == "hadamard", recent=300)
    case = dict(d=64, kv_heads=3, q_heads=9, scheme=s, capacity=300, lengths=[300, 17, 1], rot=64, interleaved=False,
                q_dtype=torch.float32, fp_dtype=torch.float32, split=64, seed=3)
    _, bufs, q, keys, values, rope, ks, vs = build(case, device)
    got = run_kernel(case, device, bufs, q, rope, ks, vs).cpu()
    want = attention_fp32(q.cpu(), keys, values, case["lengths"])
    assert (got - want).abs().max().item() <= float_tolerance(q, keys, values, torch.float32) * 4


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_pre_rope_keys_equal_rope_after_dequantizing(device, interleaved):
    """Quantize keys before RoPE, rotate in the kernel: the same as reference attention that applies
    RoPE to the dequantized keys, and at 8 bits close to attention on the post-RoPE keys."""
    s = scheme_at(8, k_group_size=1, k_block_tokens=16, pre_rope=True, sinks=2, recent=4)
    case = dict(d=128, kv_heads=2, q_heads=4, scheme=s, capacity=200, lengths=[200, 77], rot=96,
                interleaved=interleaved, q_dtype=torch.float32, fp_dtype=torch.float16, split=50, seed=11)
    _, bufs, q, keys, values, rope, ks, vs = build(case, device)
    got = run_kernel(case, device, bufs, q, rope, ks, vs).cpu()
    want = run_reference(case, bufs, q, rope, ks, vs)
    assert (got - want).abs().max().item() <= float_tolerance(q, keys, values, torch.float32)
    plain = attention_fp32(q.cpu(), keys, values, case["lengths"])
    assert (got - plain).abs().max().item() <= quantization_bound(q, bufs, values)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_is_exact_and_deterministic(device):
    s = scheme_at(4, k_group_size=1, k_block_tokens=32, v_group_size=32, sinks=4, recent=16)
    case = dict(d=128, kv_heads=2, q_heads=8, scheme=s, capacity=1000, lengths=[1000, 531, 0], rot=128,
                interleaved=False, q_dtype=torch.float32, fp_dtype=torch.float16, split=0, seed=5)
    _, bufs, q, keys, values, rope, ks, vs = build(case, device)
    outs = [run_kernel(case, device, bufs, q, rope, ks, vs, split=st).cpu() for st in (1000, 64, 33, 0)]
    tol = float_tolerance(q, keys, values, torch.float32)
    for o in outs[1:]:
        assert (o - outs[0]).abs().max().item() <= tol
    if device == "cpu":
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = run_kernel(case, device, bufs, q, rope, ks, vs, split=64)
            chosen = run_kernel(case, device, bufs, q, rope, ks, vs, split=0)
        finally:
            torch.set_num_threads(threads)
        # the merge order is fixed and the default split follows the shapes only: bit-identical across
        # thread counts
        assert torch.equal(one, outs[1])
        assert torch.equal(chosen, outs[3])


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_with_changing_lengths(device):
    torch._dynamo.reset()
    s = scheme_at(4, k_group_size=1, k_block_tokens=16, pre_rope=True, recent=8)
    case = dict(d=64, kv_heads=2, q_heads=4, scheme=s, capacity=128, lengths=[128, 50], rot=64, interleaved=False,
                q_dtype=torch.float32, fp_dtype=torch.float32, split=0, seed=2)
    _, bufs, q, _, _, rope, _, _ = build(case, device)
    args = sides(bufs)

    def step(q, lengths):
        return torch_rkv.decode_attention(q, *args, lengths, s.format, AttentionOptions(rope[0], rope[1]))

    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    compiled = torch.compile(step, fullgraph=True)
    for lengths in ([128, 50], [127, 51], [3, 0]):
        lt = torch.tensor(lengths, device=device)
        assert torch.equal(compiled(q, lt), step(q, lt))
    assert counters["stats"]["unique_graphs"] - graphs == 1  # lengths are data, not shapes: no recompile


def bad_cases(device):
    s = scheme_at(4, k_group_size=1, k_block_tokens=8, pre_rope=True, recent=4)
    case = dict(d=64, kv_heads=2, q_heads=4, scheme=s, capacity=40, lengths=[40], rot=64, interleaved=False,
                q_dtype=torch.float32, fp_dtype=torch.float32, split=0, seed=1)
    layout, bufs, q, _, _, rope, _, _ = build(case, device)
    a = buffers_args(bufs)
    n = torch.tensor([40], device=device)

    def call(q=q, args=a, lengths=n, cos=rope[0], sin=rope[1], k_signs=None, heads_ok=True, k_levels=None,
             v_levels=None, sink_logits=None):
        opts = AttentionOptions(cos, sin, False, k_signs, sink_logits=sink_logits)
        return torch_rkv.decode_attention(q, *split_sides(args, (k_levels, v_levels)), lengths, s.format, opts)

    lv = torch.arange(16, dtype=torch.float32, device=device)

    too_long = torch.tensor([layout.max_tokens + 1], device=device)
    return [
        (lambda: call(q=q[:, :3]), ValueError, "q has 3 heads, which is not a multiple of the cache's 2 kv heads"),
        (lambda: call(q=q.int()), TypeError, "q must be float32"),
        (lambda: call(lengths=n.float()), TypeError, "lengths must be int32 or int64"),
        (lambda: call(lengths=torch.tensor([1, 2], device=device)), ValueError, "lengths must have shape (1,)"),
        (lambda: call(sin=None), ValueError, "give both rope_cos and rope_sin"),
        (lambda: call(k_signs=torch.ones(64, device=device)), ValueError, "keys cannot be both pre-RoPE"),
        (lambda: call(args=[a[0][..., :-1]] + a[1:]), ValueError, "k_packed must have shape"),
        (lambda: call(k_levels=lv[:8]), ValueError, "k_levels must have shape (16,)"),
        (lambda: call(v_levels=lv.double()), TypeError, "v_levels must be float32"),
        (lambda: call(sink_logits=lv[:3]), ValueError, "sink_logits must have shape (q_heads=4,), got [3]"),
        (lambda: call(sink_logits=lv[:4].reshape(1, 4)), ValueError,
         "sink_logits must have shape (q_heads=4,), got [1, 4]"),
        (lambda: call(sink_logits=lv[:4].int()), TypeError, "sink_logits must be float32, float16 or bfloat16"),
    ], [
        (lambda: call(lengths=too_long), ValueError,
         f"lengths[0] = {layout.max_tokens + 1} is outside [0, {layout.max_tokens}]"),
        (lambda: call(cos=rope[0][:30], sin=rope[1][:30]), ValueError, "sequence 0 needs rope positions up to 39 but rope_cos has 30"),
    ]


@pytest.mark.parametrize("device", DEVICES + ["meta"])
def test_bad_input_names_the_argument(device):
    static, data = bad_cases("cpu" if device == "meta" else device)
    if device == "meta":  # the fake kernel raises the static errors at trace time
        static = [(lambda f=f: _on_meta(f), e, m) for f, e, m in static]
        data = []
    if device == "cuda":
        data = []  # a device-side assert would poison the CUDA context; the CPU checks these
    for call, exc, msg in static + data:
        with pytest.raises(exc, match=re.escape(f"rkv.decode_attention: {msg}")):
            call()


def _on_meta(fn):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        return fn()
