"""Argument checks of the fake kernels: the same rules and messages as torch_rkv/csrc/checks.cpp.

The C++ checks guard the real kernels; these run when an op is traced (torch.compile, meta or fake
tensors), so a bad call fails at trace time with the error eager mode would give. Shape conditions that
involve symbolic sizes go through torch._check_value so they become runtime asserts, not guards.
"""

from __future__ import annotations

import torch

from ..reference import ring_rows

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)
# the scales' and zeros' dtypes, with the short names schemes describe them by
META_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float8_e4m3fn: "e4m3"}
META_TYPES = tuple(META_NAMES)
BITS = (2, 3, 4, 8)
MAX_REFINED = 256  # refined key channels a kv head may have (include/rkv/paging.h kMaxRefined)


def value(cond, op: str, msg: str) -> None:
    torch._check_value(cond, lambda: f"rkv.{op}: {msg}")


def dtype(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise TypeError(f"rkv.{op}: {msg}")


def bits(op: str, arg: str, b: int) -> None:
    value(b in BITS, op, f"{arg} must be 2, 3, 4 or 8 (got {b})")


def float_dtype(op: str, arg: str, dt: torch.dtype) -> None:
    dtype(dt in FLOAT_TYPES, op, f"{arg} must be float32, float16 or bfloat16 (got {dt})")


def float_input(op: str, arg: str, t: torch.Tensor) -> None:
    float_dtype(op, arg, t.dtype)


def meta_dtype(op: str, arg: str, dt: torch.dtype) -> None:
    dtype(dt in META_TYPES, op, f"{arg} must be float32, float16, bfloat16 or float8_e4m3fn (got {dt})")


def same_device(op: str, ref: torch.Tensor, arg: str, t: torch.Tensor) -> None:
    value(t.device == ref.device, op, f"{arg} is on {t.device} but the input is on {ref.device}")


def devices(op: str, ref: torch.Tensor, **tensors) -> None:
    """Every given tensor (None skipped) on ref's device."""
    for arg, t in tensors.items():
        if t is not None:
            same_device(op, ref, arg, t)


def row_packable(op: str, arg: str, dim, b: int) -> None:
    value((dim * b) % 8 == 0, op,
          f"the last dim of {arg} ({dim}) times bits ({b}) must be a multiple of 8 to pack whole bytes")


def levels(op: str, arg: str, ref: torch.Tensor, lv, b: int, symmetric: bool) -> None:
    """A side's non-uniform levels: float32 (2^bits,) on ref's device, asymmetric codes only (checks.cpp
    check_levels; the values are checked by the CPU kernels)."""
    if lv is None:
        return
    value(not symmetric, op, f"{arg} (non-uniform levels) needs asymmetric codes; this side is symmetric (no zero)")
    dtype(lv.dtype == torch.float32, op, f"{arg} must be float32 (got {lv.dtype})")
    value(b <= 4, op, f"{arg}: non-uniform levels are for 2, 3 or 4 bits (got {b})")
    value(lv.dim() == 1 and lv.shape[0] == 1 << b, op,
          f"{arg} must have shape ({1 << b},), one value per {b}-bit code, got {list(lv.shape)}")
    same_device(op, ref, arg, lv)


def rows_contiguous(t: torch.Tensor) -> bool:
    """Contiguous within each index of dim 0 (a page or a sequence), which may be any stride apart: the
    kernels address a page's rows by offsets (checks.cpp rows_contiguous)."""
    expect = 1
    for i in range(t.dim() - 1, 0, -1):
        if t.shape[i] != 1 and t.stride(i) != expect:
            return t.numel() == 0  # nothing to address (a cache of capacity 0)
        expect *= t.shape[i]
    return True


def cache_strides(op: str, paged: bool, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero) -> None:
    """The quantized buffers' layout rules of checks.cpp check_cache_quantized: codes and scale contiguous
    within each page, zero laid out as scale."""
    for side, codes, scale, zero in (("k", k_codes, k_scale, k_zero), ("v", v_codes, v_scale, v_zero)):
        p, sc = f"{side}_{'codes' if paged else 'packed'}", f"{side}_scale"
        value(rows_contiguous(codes) and rows_contiguous(scale), op,
              f"{p} and {sc} must be contiguous within each page (their pages may be any stride apart)")
        if zero is not None and zero.shape == scale.shape:  # (a shape mismatch: the kernel names it)
            value(rows_contiguous(zero) and zero.stride(0) == scale.stride(0), op,
                  f"{side}_zero must be laid out as {sc} (contiguous within each page, the same page stride)")


def cache_outliers(op: str, ref: torch.Tensor, k_codes, v_codes, k_outliers, v_outliers, block, dim) -> None:
    """Each side's sparse-outlier buffer: int32 (pages, kv_heads, rows / block, K >= 1) on ref's device,
    contiguous within each page, with block x head_dim <= 65535 (checks.cpp check_outliers)."""
    for arg, t, codes in (("k_outliers", k_outliers, k_codes), ("v_outliers", v_outliers, v_codes)):
        if t is None:
            continue
        dtype(t.dtype == torch.int32, op, f"{arg} must be int32 (got {t.dtype})")
        same_device(op, ref, arg, t)
        value(t.dim() == 4 and t.shape[0] == codes.shape[0] and t.shape[1] == codes.shape[1]
              and t.shape[2] * block == codes.shape[2] and t.shape[3] >= 1, op,
              f"{arg} must have shape ({codes.shape[0]}, {codes.shape[1]}, {codes.shape[2] // block}, outliers per "
              f"block >= 1): one row of entries per block of {block} rows, got {list(t.shape)}")
        value(rows_contiguous(t), op, f"{arg} must be contiguous within each page (its pages may be any stride apart)")
        value(block * dim <= 0xFFFF, op, f"{arg}: outlier positions are 16 bits, so block x head_dim must be <= 65535 "
              f"(got {block} x {dim})")


def cache_refine(op: str, ref: torch.Tensor, k_codes, k_zero, k_scale, k_levels, k_outliers, k_bits, k_refine,
                 k_channels) -> None:
    """Refined key channels: k_refine uint8 (pages, kv_heads, rows, m*extra/8) contiguous within each page
    and k_channels int32 (kv_heads, m), extra 2..4, on per-channel asymmetric uniform keys without outliers
    (checks.cpp check_refine; the channels' values are checked by the kernels)."""
    value((k_refine is None) == (k_channels is None), op, "k_refine and k_channels come together (the refinement "
          "codes and which channels they refine)")
    if k_refine is None:
        return
    dim = k_codes.shape[-1] * 8 // k_bits
    dtype(k_channels.dtype == torch.int32, op, f"k_channels must be int32 (got {k_channels.dtype})")
    dtype(k_refine.dtype == torch.uint8, op, f"k_refine must be uint8 (got {k_refine.dtype})")
    same_device(op, ref, "k_refine", k_refine)
    same_device(op, ref, "k_channels", k_channels)
    heads = k_codes.shape[1]
    value(k_channels.dim() == 2 and k_channels.shape[0] == heads and 1 <= k_channels.shape[1] <= min(dim, MAX_REFINED),
          op, f"k_channels must have shape (kv_heads={heads}, m) with 1 <= m <= min(head_dim={dim}, {MAX_REFINED}), "
          f"got {list(k_channels.shape)}")
    m = k_channels.shape[1]
    value(k_refine.dim() == 4 and tuple(k_refine.shape[:3]) == tuple(k_codes.shape[:3])
          and k_refine.shape[3] * 8 % m == 0 and 2 <= k_refine.shape[3] * 8 // m <= 4, op,
          f"k_refine must have shape ({k_codes.shape[0]}, {heads}, {k_codes.shape[2]}, m * extra / 8) with m = {m} "
          f"refined channels of extra = 2, 3 or 4 bits each, got {list(k_refine.shape)}")
    value(rows_contiguous(k_refine), op, "k_refine must be contiguous within each page (its pages may be any stride "
          "apart)")
    value(k_zero is not None and k_levels is None and k_outliers is None and k_scale.shape[-1] == dim and k_bits < 8,
          op, "k_refine refines per-channel key codes: it needs asymmetric keys (k_zero), one channel per group, "
          "uniform codes below 8 bits (no k_levels) and no k_outliers")


def cache_levels(op: str, ref: torch.Tensor, k_levels, v_levels, k_bits: int, v_bits: int, k_zero, v_zero) -> None:
    levels(op, "k_levels", ref, k_levels, k_bits, k_zero is None)
    levels(op, "v_levels", ref, v_levels, v_bits, v_zero is None)


def quantize(x: torch.Tensor, b: int, group_size, block_tokens, md: torch.dtype, symmetric: bool = False,
             clip: bool = False, sink_rows=0) -> None:
    value(sink_rows >= 0, "quantize", f"sink_rows must be >= 0 (got {sink_rows})")
    bits("quantize", "bits", b)
    value(not (clip and symmetric), "quantize", "clip searches asymmetric ranges; it needs symmetric=False")
    float_input("quantize", "x", x)
    meta_dtype("quantize", "meta_dtype", md)
    value(x.dim() >= 2, "quantize", f"x must have at least 2 dims (..., tokens, dim), got shape {list(x.shape)}")
    n, d = x.shape[-2], x.shape[-1]
    row_packable("quantize", "x", d, b)
    value(group_size >= 1 and d % group_size == 0, "quantize",
          f"group_size ({group_size}) must be >= 1 and divide the last dim of x ({d})")
    value(block_tokens >= 1 and n % block_tokens == 0, "quantize",
          f"block_tokens ({block_tokens}) must be >= 1 and divide the token dim of x ({n}); "
          "quantize whole blocks and keep the rest in full precision")


def dequantize(packed: torch.Tensor, scale: torch.Tensor, zero, b: int, out_dtype: torch.dtype):
    """Returns (dim, group_size, block_tokens) read off the shapes."""
    op = "dequantize"
    bits(op, "bits", b)
    dtype(packed.dtype == torch.uint8, op, f"packed must be uint8 (got {packed.dtype})")
    meta_dtype(op, "scale", scale.dtype)
    float_dtype(op, "out_dtype", out_dtype)
    same_device(op, packed, "scale", scale)
    value(packed.dim() >= 2, op, f"packed must have at least 2 dims, got shape {list(packed.shape)}")
    value(scale.dim() == packed.dim(), op,
          f"scale must have as many dims as packed ({packed.dim()}), got shape {list(scale.shape)}")
    value(scale.shape[:-2] == packed.shape[:-2], op,
          f"the leading dims of scale {list(scale.shape)} must equal those of packed {list(packed.shape)}")
    n = packed.shape[-2]
    value((packed.shape[-1] * 8) % b == 0, op,
          f"the last dim of packed ({packed.shape[-1]} bytes) does not hold a whole number of {b}-bit codes")
    d = packed.shape[-1] * 8 // b
    nb, ng = scale.shape[-2], scale.shape[-1]
    value(ng >= 1 and d % ng == 0, op, f"scale's last dim ({ng} groups) must divide the code dim ({d})")
    value((nb >= 1 and n % nb == 0) or (nb == 0 and n == 0), op,
          f"scale's token-block dim ({nb}) must divide the token dim of packed ({n})")
    if zero is not None:
        dtype(zero.dtype == scale.dtype, op, f"zero must have scale's dtype ({scale.dtype}), got {zero.dtype}")
        value(zero.shape == scale.shape, op, f"zero must have scale's shape {list(scale.shape)}, got {list(zero.shape)}")
        same_device(op, packed, "zero", zero)
    return d


def pack(codes: torch.Tensor, b: int) -> None:
    bits("pack", "bits", b)
    dtype(codes.dtype == torch.uint8, "pack", f"codes must be uint8 (got {codes.dtype})")
    value(codes.dim() >= 1, "pack", "codes must have at least 1 dim")
    row_packable("pack", "codes", codes.shape[-1], b)


def unpack(packed: torch.Tensor, b: int) -> None:
    bits("unpack", "bits", b)
    dtype(packed.dtype == torch.uint8, "unpack", f"packed must be uint8 (got {packed.dtype})")
    value(packed.dim() >= 1, "unpack", "packed must have at least 1 dim")
    value((packed.shape[-1] * 8) % b == 0, "unpack",
          f"the last dim of packed ({packed.shape[-1]} bytes) does not hold a whole number of {b}-bit codes")


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    op = "rope"
    float_input(op, "x", x)
    float_input(op, "cos", cos)
    dtype(sin.dtype == cos.dtype, op, f"sin must have cos's dtype ({cos.dtype}), got {sin.dtype}")
    dtype(positions.dtype in (torch.int32, torch.int64), op,
          f"positions must be int32 or int64 (got {positions.dtype})")
    for arg, t in (("cos", cos), ("sin", sin), ("positions", positions)):
        same_device(op, x, arg, t)
    value(x.dim() >= 1, op, "x must have at least 1 dim")
    value(cos.dim() == 2, op, f"cos must have shape (positions, rot_dim / 2), got {list(cos.shape)}")
    value(sin.shape == cos.shape, op, f"sin must have cos's shape {list(cos.shape)}, got {list(sin.shape)}")
    d = x.shape[-1]
    value(cos.shape[1] >= 1 and 2 * cos.shape[1] <= d, op,
          f"cos/sin have {cos.shape[1]} pairs per position, but x's last dim ({d}) holds at most {d // 2}")
    rows = list(x.shape[:-1])
    ok = positions.dim() <= len(rows) and all(
        p == r or p == 1 for p, r in zip(reversed(positions.shape), reversed(rows)))
    value(ok, op, f"positions of shape {list(positions.shape)} must broadcast to x.shape[:-1] = {rows}")


def hadamard(x: torch.Tensor, signs) -> None:
    op = "hadamard"
    float_input(op, "x", x)
    value(x.dim() >= 1, op, "x must have at least 1 dim")
    d = x.shape[-1]
    value(d >= 2 and (d & -d) >= 2 and d <= 8192, op,
          f"the last dim of x ({d}) must be even and at most 8192 (a power of two is transformed whole, "
          "other sizes in blocks of their largest power-of-two divisor)")
    if signs is not None:
        float_input(op, "signs", signs)
        same_device(op, x, "signs", signs)
        value(signs.dim() == 1 and signs.shape[0] == d, op, f"signs must have shape ({d},), got {list(signs.shape)}")


def cache(op: str, batch, kv_heads, dim, k_codes, v_codes, k_window, lengths, k_bits, v_bits, block, recent,
          block_tables=None, side_slots=None, paged: bool = False) -> None:
    """The cache rules a traced call can check (csrc/checks.cpp, check_cache); the kernels check the rest."""
    bits(op, "k_bits", k_bits)
    bits(op, "v_bits", v_bits)
    value(block >= 1, op, f"block must be >= 1 (got {block})")
    value(recent >= 0, op, f"recent must be >= 0 (got {recent})")
    dtype(lengths.dtype in (torch.int32, torch.int64), op, f"lengths must be int32 or int64 (got {lengths.dtype})")
    value(lengths.dim() == 1 and lengths.shape[0] == batch, op,
          f"lengths must have shape ({batch},), got {list(lengths.shape)}")
    for name, t in (("block_tables", block_tables), ("side_slots", side_slots)):
        if t is not None:
            dtype(t.dtype == torch.int32, op, f"{name} must be int32 (got {t.dtype})")
            value(t.dim() == (2 if name == "block_tables" else 1) and t.shape[0] == batch, op,
                  f"{name} must have shape ({batch}{', max_pages' if name == 'block_tables' else ''},) with one row "
                  f"per sequence, got {list(t.shape)}")
    tabled = block_tables is not None
    prefix = "k_codes" if paged else "k_packed"
    for name, t, b in ((prefix, k_codes, k_bits), (prefix.replace("k_", "v_"), v_codes, v_bits)):
        dtype(t.dtype == torch.uint8, op, f"{name} must be uint8 (got {t.dtype})")
        first = "pages" if tabled else ("pages" if paged else "batch") + f"={batch}"
        value(t.dim() == 4 and (tabled or t.shape[0] == batch) and t.shape[1] == kv_heads and t.shape[-1] * 8 == dim * b,
              op, f"{name} must have shape ({first}, kv_heads={kv_heads}, {'page_size' if paged else 'capacity'}, "
              f"{dim * b // 8}) for head_dim {dim} at {b} bits, got {list(t.shape)}")
    value(k_window.dim() == 4 and k_window.shape[2] >= recent + block - 1, op,
          f"the window ring ({k_window.shape[2] if k_window.dim() == 4 else '?'} tokens) must hold "
          f"recent + block - 1 = {recent + block - 1} tokens")


def attention_extras(op: str, rope_cos, rope_sin, k_signs) -> None:
    value((rope_cos is None) == (rope_sin is None), op, "give both rope_cos and rope_sin (pre-RoPE keys) or neither")
    value(rope_cos is None or k_signs is None, op,
          "keys cannot be both pre-RoPE (rope_cos) and Hadamard-rotated (k_signs): RoPE does not commute with the rotation")


def kv_heads_of(op: str, k_codes, paged: bool) -> int:
    value(k_codes.dim() == 4, op, f"{'k_codes' if paged else 'k_packed'} must have shape "
          f"({'pages' if paged else 'batch'}, kv_heads, {'page_size' if paged else 'capacity'}, bytes), got "
          f"{list(k_codes.shape)}")
    return k_codes.shape[1]


def decode_attention(q, k_packed, v_packed, k_window, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin,
                     k_signs, block_tables=None, side_slots=None, op: str = "decode_attention") -> None:
    """The shape rules a traced call can check; csrc/checks.cpp checks the rest when the kernel runs."""
    paged = op != "decode_attention"
    float_input(op, "q", q)
    value(q.dim() == 3, op, f"q must have shape (batch, q_heads, head_dim), got {list(q.shape)}")
    hkv = kv_heads_of(op, k_packed, paged)
    value(hkv >= 1 and q.shape[1] % hkv == 0, op,
          f"q has {q.shape[1]} heads, which is not a multiple of the cache's {hkv} kv heads")
    cache(op, q.shape[0], hkv, q.shape[-1], k_packed, v_packed, k_window, lengths, k_bits, v_bits, block, recent,
          block_tables, side_slots, paged)
    attention_extras(op, rope_cos, rope_sin, k_signs)


def new_tokens(op: str, k_new, v_new, k_window, dims: int) -> None:
    float_input(op, "k_new", k_new)
    shape = "(batch, kv_heads, tokens, head_dim)" if dims == 4 else "(tokens, kv_heads, head_dim)"
    value(k_new.dim() == dims, op, f"k_new must have shape {shape}, got {list(k_new.shape)}")
    value(v_new.shape == k_new.shape, op, f"v_new must have k_new's shape {list(k_new.shape)}, got {list(v_new.shape)}")
    dtype(k_new.dtype == k_window.dtype and v_new.dtype == k_window.dtype, op,
          f"k_new and v_new must have the cache's full-precision dtype (k_window: {k_window.dtype}), got "
          f"{k_new.dtype} and {v_new.dtype}")


def cache_append(k_packed, v_packed, k_window, lengths, k_new, v_new, k_bits, v_bits, block, recent,
                 k_zero=None, v_zero=None, k_clip=False, v_clip=False) -> None:
    op = "cache_append"
    value(not (k_clip and k_zero is None), op, "k_clip needs asymmetric keys (k_zero)")
    value(not (v_clip and v_zero is None), op, "v_clip needs asymmetric values (v_zero)")
    new_tokens(op, k_new, v_new, k_window, 4)
    b, h, _, d = k_new.shape
    cache(op, b, h, d, k_packed, v_packed, k_window, lengths, k_bits, v_bits, block, recent)


def query_start_loc(op: str, qsl, batch) -> None:
    dtype(qsl.dtype in (torch.int32, torch.int64), op, f"query_start_loc must be int32 or int64 (got {qsl.dtype})")
    value(qsl.dim() == 1 and qsl.shape[0] == batch + 1, op,
          f"query_start_loc must have shape ({batch + 1},) (batch + 1 cumulative counts), got {list(qsl.shape)}")


def paged_append(k_codes, v_codes, k_window, page_fill, block_tables, side_slots, lengths, qsl, k_new, v_new, k_bits,
                 v_bits, block, recent, k_zero=None, v_zero=None, k_clip=False, v_clip=False, slot_mapping=None):
    op = "paged_append"
    value(not (k_clip and k_zero is None), op, "k_clip needs asymmetric keys (k_zero)")
    value(not (v_clip and v_zero is None), op, "v_clip needs asymmetric values (v_zero)")
    new_tokens(op, k_new, v_new, k_window, 3)
    batch = lengths.shape[0] if lengths.dim() == 1 else 0
    query_start_loc(op, qsl, batch)
    cache(op, batch, k_new.shape[1], k_new.shape[2], k_codes, v_codes, k_window, lengths, k_bits, v_bits, block,
          recent, block_tables, side_slots, paged=True)
    if page_fill is not None:
        dtype(page_fill.dtype == torch.int32, op, f"page_fill must be int32 (got {page_fill.dtype})")
    if slot_mapping is not None:
        dtype(slot_mapping.dtype in (torch.int32, torch.int64), op,
              f"slot_mapping must be int32 or int64 (got {slot_mapping.dtype})")


def paged_prefill_attention(q, k_new, v_new, qsl, max_query_len, k_codes, v_codes, k_window, block_tables,
                            side_slots, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, k_signs) -> None:
    op = "paged_prefill_attention"
    float_input(op, "q", q)
    value(q.dim() == 3, op, f"q must have shape (tokens, q_heads, head_dim), got {list(q.shape)}")
    value(max_query_len >= 0, op, f"max_query_len must be >= 0 (got {max_query_len})")
    hkv = kv_heads_of(op, k_codes, True)
    value(hkv >= 1 and q.shape[1] % hkv == 0, op,
          f"q has {q.shape[1]} heads, which is not a multiple of the cache's {hkv} kv heads")
    new_tokens(op, k_new, v_new, k_window, 3)
    value(k_new.shape[0] == q.shape[0] and k_new.shape[1] == hkv and k_new.shape[2] == q.shape[2], op,
          f"k_new must have shape ({q.shape[0]}, {hkv}, {q.shape[2]}) (tokens, heads, head_dim), got {list(k_new.shape)}")
    batch = qsl.shape[0] - 1 if qsl.dim() == 1 else 0
    query_start_loc(op, qsl, batch)
    cache(op, batch, hkv, q.shape[-1], k_codes, v_codes, k_window, lengths, k_bits, v_bits, block, recent,
          block_tables, side_slots, paged=True)
    attention_extras(op, rope_cos, rope_sin, k_signs)


def sink_logits(op: str, q: torch.Tensor, sink_logits) -> None:
    """Learned attention sinks: None, or one float logit per query head (Hq,) on q's device (cache_call.cpp
    attach_sink_logits)."""
    if sink_logits is None:
        return
    float_input(op, "sink_logits", sink_logits)
    value(sink_logits.dim() == 1 and sink_logits.shape[0] == q.shape[1], op,
          f"sink_logits must have shape (q_heads={q.shape[1]},), got {list(sink_logits.shape)}")
    same_device(op, q, "sink_logits", sink_logits)


def window_and_cap(op: str, sliding_window, softcap, packed_rows=None, block=1, append_tokens=None) -> None:
    """sliding_window >= 0 and softcap finite >= 0 (0: none); packed_rows: a contiguous cache, which a
    sliding window makes a ring of at least ring_rows packed rows; append_tokens: the tokens cache_append
    writes into it at once (at most its rows - block + 1)."""
    value(sliding_window >= 0, op, f"sliding_window must be >= 0 (0: none), got {sliding_window}")
    value(softcap >= 0 and softcap != float("inf"), op, f"softcap must be finite and >= 0 (0: none), got {softcap}")
    if packed_rows is None or sliding_window == 0:
        return
    need = ring_rows(sliding_window, block)
    value(packed_rows >= need, op, f"a sliding window of {sliding_window} tokens needs a ring of at least {need} "
                                   f"packed rows (k_packed has {packed_rows})")
    if append_tokens is not None:
        most = packed_rows - block + 1
        value(append_tokens <= most, op, f"a ring of {packed_rows} packed rows (sliding_window={sliding_window}) takes "
                                         f"at most {most} tokens per append (k_new has {append_tokens}); append in pieces")
