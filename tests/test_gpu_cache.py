"""The Triton append kernels (torch_rkv.gpu.cache: paged_append, cache_append) under Triton's interpreter on
CPU tensors: every byte of every cache tensor equals reference.paged_append's / cache_append's and the C++
CPU kernel's (canary-filled pools, NaN padding rows, spare pages and slots show any stray read or write),
the outlier selection equals reference.select_outliers on tie-heavy inputs, every data-dependent error of
the CPU kernel comes with its message and before any write, and the device-side guards write nothing out
of place."""

import re

import pytest
import torch
from cachebuild import buffers_args, levels_of, outliers_args, random_levels
from conftest import TRITON_EXAMPLES, noncontiguous
from hypothesis import given, settings
from hypothesis import strategies as st
from pagedbuild import SIDES, Pool
from test_cache import append_cases
from test_paged import schemes

import torch_rkv  # noqa: F401  (the C++ ops)
from torch_rkv import reference as ref
from torch_rkv.gpu import cache as gpu
from torch_rkv.gpu import outliers as gpu_outliers
from torch_rkv.layout import CacheLayout, PageLayout

# the C++ CPU kernels, called flat in the op schema's order as the Triton implementations are (the wrappers in
# torch_rkv.ops take CacheSide / CacheFormat and only forward to these ops)
cpu_ops = torch.ops.rkv

# the interpreter evaluates masked-off lanes too, and the selection's float32 gains overflow on purpose
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# --------------------------------------------------------------------------------------------------
# paged_append
# --------------------------------------------------------------------------------------------------


@st.composite
def paged_cases(draw):
    """A canary-filled pool with sequences already holding `offsets` tokens (their pages in random order,
    page_fill as earlier appends left it; sequence 1 may share sequence 0's first, full page), ragged steps
    of new tokens with NaN padding rows around them."""
    s = draw(schemes())
    s = s.replace(outliers=draw(st.sampled_from([0.0, 0.0, 0.0, 0.02]), label="outliers"))
    page = draw(st.sampled_from([8, 16]), label="page")
    batch, heads = draw(st.integers(1, 3), label="batch"), draw(st.integers(1, 2), label="heads")
    offsets = [draw(st.integers(0, 2 * page)) for _ in range(batch)]
    steps = draw(st.lists(st.lists(st.integers(0, 11), min_size=batch, max_size=batch), min_size=1, max_size=3))
    share = batch >= 2 and draw(st.booleans(), label="shared prefix")
    if share:
        offsets[0], offsets[1] = max(offsets[0], page), max(offsets[1], page)
    return dict(scheme=s, page=page, batch=batch, heads=heads, offsets=offsets, steps=steps, share=share,
                dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), label="dtype"),
                seed=draw(st.integers(0, 2**16), label="seed"), levels=draw(st.booleans(), label="levels"),
                index=draw(st.sampled_from([torch.int32, torch.int64]), label="index dtype"),
                mapping=draw(st.booleans(), label="slot_mapping"), fill=draw(st.sampled_from([True, True, False])),
                pad=(draw(st.integers(0, 2)), draw(st.integers(0, 2))), strided=draw(st.booleans(), label="strided"))


def paged_pool(case):
    """(pool, tables, slots): random disjoint pages and slots (a spare page and slot beyond them)."""
    s, page, batch = case["scheme"], case["page"], case["batch"]
    gen = torch.Generator().manual_seed(case["seed"])
    totals = [n + sum(step[b] for step in case["steps"]) for b, n in enumerate(case["offsets"])]
    need = [max(1, -(-n // page)) for n in totals]
    width = max(need)
    pages = batch * width + 2  # (every table takes `width` pages, the longest sequence's)
    pool = Pool(PageLayout(s, case["heads"], 32, page, case["dtype"]), pages, batch + 1, gen)
    order = torch.randperm(pages, generator=gen).tolist()
    tables = torch.tensor([[order.pop() for _ in range(width)] for _ in range(batch)], dtype=torch.int32)
    if case["share"]:
        tables[1, 0] = tables[0, 0]
    for b, n in enumerate(case["offsets"]):  # the quantized rows of each page: the blocks completed so far
        done = n // s.block * s.block
        for j in range(-(-done // page)):
            pool.fill[tables[b, j]] = min(page, done - j * page)
    slots = torch.randperm(batch + 1, generator=gen)[:batch].to(torch.int32)
    return pool, tables, slots, gen


def new_rows(case, counts, gen, heads, dim=32):
    """k_new / v_new rows (T, H, D) with NaN padding rows before and after, and their query_start_loc."""
    front, back = case["pad"]
    total = front + sum(counts) + back
    out = []
    for _ in range(2):
        x = torch.randn(total, heads, dim, generator=gen).to(case["dtype"])
        x[:front] = float("nan")
        x[total - back:] = float("nan")
        out.append(noncontiguous(x) if case["strided"] else x)
    qsl = (front + torch.tensor([0] + counts).cumsum(0)).to(case["index"])
    return out[0], out[1], qsl


def slot_mapping_of(tables, lengths, counts, qsl, total, page):
    m = torch.full((total,), -7, dtype=torch.int64)
    for b, c in enumerate(counts):
        for i in range(c):
            t = int(lengths[b]) + i
            m[int(qsl[b]) + i] = int(tables[b, t // page]) * page + t % page
    return m


def pool_outliers(pool):
    return {name: pool.views.get(name) for name in ("k_outliers", "v_outliers")}


def assert_pools_equal(got: Pool, want: Pool):
    assert torch.equal(got.raw, want.raw), "pages (codes, metadata, outlier entries, padding)"
    assert torch.equal(got.fill, want.fill), "page_fill"
    for name in SIDES:
        assert torch.equal(got.side[name].view(torch.uint8), want.side[name].view(torch.uint8)), name


# the interpreter runs each kernel's programs one by one in Python: twice conftest's example count for it
# (these two tests are the file's broad coverage), at most the profile's
EXAMPLES = settings(max_examples=min(settings().max_examples, 2 * TRITON_EXAMPLES))


@EXAMPLES
@given(case=paged_cases())
def test_paged_append_matches_the_reference_and_the_cpu_kernel(case):
    s = case["scheme"]
    want, tables, slots, gen = paged_pool(case)
    cpu, got = want.clone(), want.clone()
    kl, vl = levels_of(s, case["seed"], case["levels"])
    lengths = torch.tensor(case["offsets"], dtype=case["index"])
    args = (s.k_bits, s.v_bits, s.block, s.recent, s.k_clip, s.v_clip)
    for counts in case["steps"]:
        k, v, qsl = new_rows(case, counts, gen, case["heads"])
        mapping = slot_mapping_of(tables, lengths, counts, qsl, k.shape[0], case["page"]) if case["mapping"] else None
        fills = [p.fill if case["fill"] else None for p in (want, cpu, got)]
        ref.paged_append(*want.tensors(), fills[0], tables, slots, lengths, qsl, k, v, *args, slot_mapping=mapping,
                         k_levels=kl, v_levels=vl, **pool_outliers(want))
        cpu_ops.paged_append(*cpu.tensors(), fills[1], tables, slots, lengths, qsl, k, v, *args, slot_mapping=mapping,
                             k_levels=kl, v_levels=vl, **pool_outliers(cpu))
        gpu.paged_append(*got.tensors(), fills[2], tables, slots, lengths, qsl, k, v, *args, slot_mapping=mapping,
                         k_levels=kl, v_levels=vl, **pool_outliers(got))
        assert_pools_equal(cpu, want)
        assert_pools_equal(got, want)
        lengths = lengths + torch.tensor(counts, dtype=case["index"])


# --------------------------------------------------------------------------------------------------
# cache_append (the contiguous layout, and its sliding-window ring)
# --------------------------------------------------------------------------------------------------


@st.composite
def cache_cases(draw):
    case = draw(append_cases())
    s = case["scheme"]
    case["scheme"] = s.replace(outliers=0.02 if s.outliers else 0.0)
    case["chunks"] = case["chunks"][:3]
    case["dtype"] = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]), label="dtype")
    case["strided"] = draw(st.booleans(), label="strided")
    return case


@EXAMPLES
@given(case=cache_cases())
def test_cache_append_matches_the_reference_and_the_cpu_kernel(case):
    s, w = case["scheme"], case["window"]
    total = sum(case["chunks"]) + max(case["offsets"])
    layout = CacheLayout(s, case["batch"], case["heads"], case["dim"], total, case["dtype"], w)
    step = layout.packed_capacity - s.block + 1  # the most a ring takes per append
    chunks = [min(m, step) for m in case["chunks"]] if w else case["chunks"]
    gen = torch.Generator().manual_seed(case["seed"])
    want = {}
    for name, (shape, dt) in layout.shapes().items():  # canaries: random bytes everywhere
        want[name] = torch.randint(0, 255, shape, generator=gen, dtype=torch.uint8)
        if dt != torch.uint8:
            want[name] = want[name].to(torch.int32) if dt == torch.int32 else torch.randn(shape, generator=gen).to(dt)
    cpu = {k: v.clone() for k, v in want.items()}
    got = {k: v.clone() for k, v in want.items()}
    lengths = torch.tensor(case["offsets"][: case["batch"]])
    args = (s.k_bits, s.v_bits, s.block, s.recent, s.k_clip, s.v_clip, w)
    for m in chunks:
        k, v = (torch.randn(case["batch"], case["heads"], m, case["dim"], generator=gen).to(case["dtype"])
                for _ in range(2))
        if case["strided"]:
            k, v = noncontiguous(k), noncontiguous(v)
        ref.cache_append(*buffers_args(want), lengths, k, v, *args, **outliers_args(want))
        cpu_ops.cache_append(*buffers_args(cpu), lengths, k, v, *args, **outliers_args(cpu))
        gpu.cache_append(*buffers_args(got), lengths, k, v, *args, **outliers_args(got))
        lengths = lengths + m
    for name in want:
        assert torch.equal(cpu[name].view(torch.uint8), want[name].view(torch.uint8)), name
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name


# --------------------------------------------------------------------------------------------------
# Every bit width, tile kind and flag at once, with blocks longer than their tiles and strided pages
# --------------------------------------------------------------------------------------------------


def strided_pages(pages, shape, dtype, gen, pad=5):
    """A (pages, *shape) tensor whose pages lie `pad` elements apart more than their size (views into one
    canary-filled buffer, as the layout's page views are): writes between pages would show."""
    per = 1
    for x in shape:
        per *= x
    if dtype == torch.uint8:
        raw = torch.randint(0, 256, (pages, per + pad), generator=gen, dtype=torch.uint8)
    elif dtype == torch.int32:
        raw = torch.randint(-(2**31), 2**31 - 1, (pages, per + pad), generator=gen, dtype=torch.int32)
    else:
        raw = torch.randn(pages, per + pad, generator=gen).to(dtype)
    return raw, raw[:, :per].view(pages, *shape)


def custom_cache(seed, heads, dim, page, block, sides, meta_dtype, dtype, sinks, window, pages, slots, outliers):
    """Buffers not made by a layout: each side (bits, rows per metadata tile, group size, symmetric) with
    its own tile, blocks of `block` rows (a multiple of both tiles), pages any stride apart."""
    gen = torch.Generator().manual_seed(seed)
    raws, views = [], {}
    for side, (bits, tile, group, symmetric) in zip("kv", sides):
        for name, shape, dt in ((f"{side}_codes", (heads, page, dim * bits // 8), torch.uint8),
                                (f"{side}_scale", (heads, page // tile, dim // group), meta_dtype),
                                (f"{side}_zero", (heads, page // tile, dim // group), meta_dtype),
                                (f"{side}_outliers", (heads, page // block, outliers), torch.int32)):
            if (name.endswith("zero") and symmetric) or (name.endswith("outliers") and not outliers):
                continue
            raw, views[name] = strided_pages(pages, shape, dt, gen)
            raws.append(raw)
        if not symmetric:  # zero laid out as scale: the same page stride
            raw = torch.randn(pages, views[f"{side}_scale"].stride(0), generator=gen).to(meta_dtype)
            raws.append(raw)
            views[f"{side}_zero"] = raw.as_strided(views[f"{side}_scale"].shape, views[f"{side}_scale"].stride())
    for name, rows in (("k_window", window), ("v_window", window), ("k_sink", sinks), ("v_sink", sinks)):
        views[name] = torch.randn(slots, heads, rows, dim, generator=gen).to(dtype)
        raws.append(views[name])
    return raws, views


CACHE_NAMES = ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "k_window", "v_window", "k_sink",
               "v_sink")


SIDE_KINDS = [  # (bits, tile rows, group, symmetric): per-token, grouped, per-channel (a tile of 4 or 8 rows)
    ((2, 1, 32, False), (3, 4, 1, True)),
    ((3, 8, 1, False), (8, 1, 16, True)),
    ((4, 1, 16, True), (2, 8, 1, False)),
    ((8, 4, 1, False), (4, 1, 32, False)),
]


@pytest.mark.parametrize("kinds", SIDE_KINDS, ids=lambda k: "-".join(f"{b}b{t}x{g}{'s' if s else 'a'}" for b, t, g, s in k))
def test_paged_append_every_width_and_tile_with_long_blocks(kinds):
    """Blocks of 8 rows quantized in tiles of 1, 4 or 8 rows, each side its own width, groups, levels
    (asymmetric, up to 4 bits), clip (asymmetric) and 3 sparse outliers a block; metadata in bfloat16,
    fp16 rows, sinks spanning a block, a window ring shorter than a block, pages any stride apart. Ragged
    appends complete several blocks of one page at once, or none."""
    heads, dim, page, block, sinks, recent = 2, 32, 16, 8, 5, 2
    lv = [random_levels(b, seed) if not s and b <= 4 else None for seed, (b, _, _, s) in enumerate(kinds)]
    clips = [not s for (_, _, _, s) in kinds]
    tables = torch.tensor([[5, 2, 0], [1, 6, 3]], dtype=torch.int32)
    side_slots = torch.tensor([2, 0], dtype=torch.int32)
    states = [custom_cache(7, heads, dim, page, block, kinds, torch.bfloat16, torch.float16, sinks,
                           recent + block - 1, 7, 3, 3) for _ in range(3)]
    gen = torch.Generator().manual_seed(1)
    lengths = torch.tensor([3, 0])
    for counts in ([21, 1], [1, 17], [0, 0]):
        k = torch.randn(sum(counts), heads, dim, generator=gen).half()
        v = torch.randn(sum(counts), heads, dim, generator=gen).half()
        qsl = torch.tensor([0] + counts).cumsum(0)
        for impl, (_, b) in zip((ref.paged_append, cpu_ops.paged_append, gpu.paged_append), states):
            impl(*[b.get(n) for n in CACHE_NAMES], None, tables, side_slots, lengths, qsl, k, v, kinds[0][0],
                 kinds[1][0], block, recent, clips[0], clips[1], k_levels=lv[0], v_levels=lv[1],
                 k_outliers=b.get("k_outliers"), v_outliers=b.get("v_outliers"))
        for want, cpu, got in zip(*(raws for raws, _ in states)):
            assert torch.equal(cpu.view(torch.uint8), want.view(torch.uint8)), "the C++ kernel"
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "the Triton kernels"
        lengths = lengths + torch.tensor(counts)


# --------------------------------------------------------------------------------------------------
# The outlier selection kernel against reference.select_outliers
# --------------------------------------------------------------------------------------------------


def select_by_kernel(x, count, tile_rows, group, sinks):
    """select_kernel's mask for x (H, n, D) float32: one staged block of H slabs, written, `sinks` sink rows."""
    h, n, d = x.shape
    groups = (n // tile_rows) * (d // group)
    table = torch.tensor([[0, 0, sinks, 1, 0, 0, 0, 0]], dtype=torch.int64)
    mask = torch.full((h, n, d), 7, dtype=torch.uint8)  # the kernel clears its slab first
    gains = torch.full((h, 2 * groups), float("nan"))
    gpos = torch.full((h, 2 * groups), -1, dtype=torch.int32)
    gpu_outliers.select_kernel[(1, h)](x.contiguous(), mask, gains, gpos, table, h, d, n, tile_rows, group, d // group,
                                       groups, tile_rows * group, count, GB=gpu_outliers.GROUP_TILE,
                                       MB=gpu_outliers.ELEM_TILE, RB=gpu_outliers.RESCAN_TILE, ZB=gpu_outliers.COPY_TILE)
    return mask.bool()


VALUES = [-2.0, -1.0, -0.0, 0.0, 0.5, 1.0, 3.0, float("inf"), -float("inf"), float("nan"), 0.1, 1.7, 1.5e19, -2e19,
          3e38, -3e38]


@given(st.data())
def test_the_selection_kernel_takes_what_the_reference_takes(data):
    """Ties, infinities, NaN, signed zeros and ranges that overflow (test_outliers' pool of values), groups
    longer than the kernel's element tile and more groups than its group tile, sink rows, any count."""
    tile_rows = data.draw(st.sampled_from([1, 2, 4]), label="tile rows")
    group = data.draw(st.sampled_from([1, 3, 80]), label="group")
    n = tile_rows * data.draw(st.integers(1, 3))
    d = group * data.draw(st.integers(1, 2 if group == 80 else 20))
    h = data.draw(st.integers(1, 2))
    x = torch.tensor(data.draw(st.lists(st.sampled_from(VALUES), min_size=h * n * d, max_size=h * n * d)))
    x = x.reshape(h, n, d)
    count = data.draw(st.integers(0, 12))
    sinks = data.draw(st.integers(0, n))
    assert torch.equal(select_by_kernel(x, count, tile_rows, group, sinks), ref.select_outliers(x, count, tile_rows,
                                                                                                   group, sinks))


def test_the_selection_kernel_on_pinned_ties():
    """Equal values at a group's ends: one per-channel group of 4 rows and the same column again as a
    second group (test_outliers' pinned cases), every count."""
    for column in ([1.0, 2.0, 2.0, 3.0], [2.0, 3.0, 3.0, 1.0], [5.0, 5.0, 1.0, 5.0], [0.0, -0.0, 0.0, 1.0],
                   [float("inf"), 1.0, 2.0, float("nan")], [4.0, 4.0, 4.0, 4.0]):
        x = torch.tensor(column).reshape(1, 4, 1).repeat(1, 1, 2)
        for count in range(6):
            assert torch.equal(select_by_kernel(x, count, 4, 1, 0), ref.select_outliers(x, count, 4, 1)), (column, count)


# --------------------------------------------------------------------------------------------------
# The sliding-window ring of cache_append
# --------------------------------------------------------------------------------------------------


def test_cache_append_ring_wraps_as_the_reference():
    """A sliding window of 6 over blocks of 4: a ring of 8 packed rows, appends of up to 5 tokens (the
    most a ring of 8 takes) that wrap it several times, with sinks, per-channel keys and sparse outliers
    (some blocks with fewer than their 3)."""
    from torch_rkv.scheme import Scheme

    s = Scheme(k_bits=3, v_bits=4, k_group_size=1, k_block_tokens=4, v_symmetric=True, sinks=1, recent=2,
               outliers=0.02, meta_dtype=torch.float16)
    layout = CacheLayout(s, 2, 1, 32, 64, torch.float16, 6)
    assert layout.packed_capacity == 8
    gen = torch.Generator().manual_seed(5)
    want = {n: (torch.randn(shape, generator=gen) * 3).to(dt) if dt.is_floating_point
            else torch.randint(0, 120, shape, generator=gen).to(dt) for n, (shape, dt) in layout.shapes().items()}
    cpu, got = ({k: v.clone() for k, v in want.items()} for _ in range(2))
    lengths = torch.tensor([0, 3])
    args = (s.k_bits, s.v_bits, s.block, s.recent, False, False, 6)
    for m in (5, 1, 5, 4, 5, 0, 5):
        k, v = (torch.randn(2, 1, m, 32, generator=gen).half() for _ in range(2))
        for x in (k, v):  # sequence 1 takes values of three levels: its groups run out of outliers that shrink
            x[1] = x[1].round().clamp(-1, 1)  # them, and its blocks' entries stay partly empty
        ref.cache_append(*buffers_args(want), lengths, k, v, *args, **outliers_args(want))
        cpu_ops.cache_append(*buffers_args(cpu), lengths, k, v, *args, **outliers_args(cpu))
        gpu.cache_append(*buffers_args(got), lengths, k, v, *args, **outliers_args(got))
        for name in want:
            assert torch.equal(cpu[name].view(torch.uint8), want[name].view(torch.uint8)), name
            assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
        lengths = lengths + m


# --------------------------------------------------------------------------------------------------
# Errors: the C++ kernel's messages, before any write
# --------------------------------------------------------------------------------------------------


def error_pool(seed=0):
    """A canary-filled pool of 4 pages of 16 rows and 2 side slots; blocks of 4, page 0 of sequence 0 full."""
    from torch_rkv import scheme as presets

    s = presets.kivi(4, block=4, recent=4)
    pool = Pool(PageLayout(s, 1, 32, 16, torch.float32), 4, 2, torch.Generator().manual_seed(seed))
    pool.fill[0] = 16
    return s, pool


def paged_call(impl, pool, s, tables, slots, lengths, counts, qsl=None, mapping=None, rows=None, k_levels=None,
               fill=True):
    qsl = torch.tensor([0] + counts).cumsum(0) if qsl is None else torch.tensor(qsl)
    k = torch.randn(sum(counts) if rows is None else rows, 1, 32, generator=torch.Generator().manual_seed(1))
    impl(*pool.tensors(), pool.fill if fill else None, torch.tensor(tables, dtype=torch.int32),
         torch.tensor(slots, dtype=torch.int32), torch.tensor(lengths), qsl, k, k.clone(), s.k_bits, s.v_bits, s.block,
         s.recent, slot_mapping=None if mapping is None else torch.tensor(mapping), k_levels=k_levels)


PAGED_ERRORS = {  # (tables, slots, lengths, counts, keywords)
    "page outside the pool": ([[2, 7], [1, 3]], [0, 1], [15, 0], [2, 1], {}),
    "negative page": ([[2, -1], [1, 3]], [0, 1], [15, 0], [2, 1], {}),
    "outgrowing the table": ([[2, 1], [0, 3]], [0, 1], [30, 0], [3, 1], {}),
    "slot outside the pool": ([[2, 1], [0, 3]], [0, 5], [0, 0], [1, 1], {}),
    "a page two sequences fill": ([[2, 1], [2, 3]], [0, 1], [0, 0], [1, 1], {}),
    "a write into a full page": ([[2, 1], [0, 3]], [0, 1], [0, 3], [1, 1], {}),
    "slot_mapping": ([[2, 1], [0, 3]], [0, 1], [0, 0], [1, 1], dict(mapping=[32, 5])),
    "query_start_loc past the rows": ([[2, 1], [0, 3]], [0, 1], [0, 0], [1, 1], dict(qsl=[0, 1, 3])),
    "query_start_loc decreasing": ([[2, 1], [0, 3]], [0, 1], [0, 0], [1, 1], dict(qsl=[0, 2, 1], rows=2)),
    "negative length": ([[2, 1], [0, 3]], [0, 1], [-1, 0], [1, 1], {}),
    "levels not ascending": ([[2, 1], [0, 3]], [0, 1], [0, 0], [1, 1],
                             dict(k_levels=torch.tensor([0.0, 3.0, 2.0] + [4.0 + i for i in range(13)]))),
}


@pytest.mark.parametrize("name", PAGED_ERRORS)
def test_paged_append_errors_as_the_cpu_kernel_and_writes_nothing(name):
    tables, slots, lengths, counts, kw = PAGED_ERRORS[name]
    s, pool = error_pool()
    before = pool.clone()
    with pytest.raises((ValueError, TypeError)) as cpu_error:
        paged_call(cpu_ops.paged_append, pool, s, tables, slots, lengths, counts, **kw)
    assert_pools_equal(pool, before)
    with pytest.raises(type(cpu_error.value), match=re.escape(str(cpu_error.value))):
        paged_call(gpu.paged_append, pool, s, tables, slots, lengths, counts, **kw)
    assert_pools_equal(pool, before)


def test_static_errors_as_the_cpu_kernel():
    """Shape and layout rules the kernels rely on, with the C++ messages."""
    s, pool = error_pool()
    t = pool.tensors()
    bad_scale = list(t)
    bad_scale[1] = t[1][:, :, :3]  # k_scale with 3 token blocks for 16 rows
    bad_window = list(t)
    bad_window[6] = t[6].transpose(2, 3).contiguous().transpose(2, 3)  # k_window not contiguous
    bad_zero = list(t)
    bad_zero[2] = torch.empty_strided(t[1].shape, t[1].stride(), dtype=torch.float32)  # k_scale's layout, not its dtype
    for cache in (bad_scale, bad_window, bad_zero):
        k = torch.randn(2, 1, 32)
        args = (None, torch.tensor([[2, 1], [0, 3]], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                torch.tensor([0, 0]), torch.tensor([0, 1, 2]), k, k, s.k_bits, s.v_bits, s.block, s.recent)
        with pytest.raises((ValueError, TypeError)) as cpu_error:
            cpu_ops.paged_append(*cache, *args)
        with pytest.raises(type(cpu_error.value), match=re.escape(str(cpu_error.value))):
            gpu.paged_append(*cache, *args)


def test_cache_append_over_capacity_errors_as_the_cpu_kernel():
    from torch_rkv import scheme as presets

    s = presets.kivi(4, block=4, recent=2)
    bufs = CacheLayout(s, 2, 1, 32, 10, torch.float32).allocate()
    before = {k: v.clone() for k, v in bufs.items()}
    k = torch.randn(2, 1, 5, 32)
    for impl in (cpu_ops.cache_append, gpu.cache_append):
        with pytest.raises(ValueError, match=re.escape("rkv.cache_append: appending 5 tokens to sequence 1 of 8 "
                                                       "tokens exceeds its capacity of 12 tokens (1 page of 12)")):
            impl(*buffers_args(bufs), torch.tensor([0, 8]), k, k, 4, 4, s.block, s.recent)
        assert all(torch.equal(bufs[n], before[n]) for n in bufs)


# --------------------------------------------------------------------------------------------------
# The device-side guards (what a CUDA call does with data the CPU checks would refuse)
# --------------------------------------------------------------------------------------------------


def test_the_kernels_write_nothing_out_of_place_when_the_checks_are_skipped():
    """_append without the host checks, as on CUDA: a block whose page is outside the pool, a block into
    rows its page already holds, and a sequence whose side slot is outside the pool write no page row,
    page_fill stays, and only the valid side slots get their tokens' sink and window rows."""
    from torch_rkv import scheme as presets

    s = presets.kivi(4, block=4, recent=2).replace(sinks=1)
    gen = torch.Generator().manual_seed(3)
    pool = Pool(PageLayout(s, 1, 32, 8, torch.float32), 6, 3, gen)
    pool.fill[2] = 8
    good = pool.clone()
    k = torch.randn(12, 1, 32, generator=gen)
    v = torch.randn(12, 1, 32, generator=gen)
    qsl = torch.tensor([0, 4, 8, 12])
    lengths = torch.tensor([0, 4, 0])
    bad_tables = torch.tensor([[9, 9], [2, 0], [4, 5]], dtype=torch.int32)  # page 9 of 6; page 2 is full
    bad_slots = torch.tensor([0, 1, 7], dtype=torch.int32)  # slot 7 of 3
    before = pool.clone()
    gpu._append(tuple(pool.tensors()), pool.fill, bad_tables, bad_slots, lengths, qsl, 0, k, v,
                s.k_bits, s.v_bits, s.block, s.recent, (False, False), (None, None), (None, None), None, False, True)
    assert torch.equal(pool.raw, before.raw) and torch.equal(pool.fill, before.fill)
    # what the sink and window rows of slots 0 and 1 receive: the same append with valid pages and no guard
    ref.paged_append(*good.tensors(), None, torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32),
                     torch.tensor([0, 1, 2], dtype=torch.int32), lengths, torch.tensor([0, 4, 8, 8]), k[:8], v[:8],
                     s.k_bits, s.v_bits, s.block, s.recent)
    for name in SIDES:
        assert torch.equal(pool.side[name], good.side[name]), name
