"""What a vLLM engine holds in a given memory, with the plugin or with its own cache: vLLM's KV pages,
sized from the bytes each page publishes (content_bytes), and the plugin's side pool of full-precision
rows beside them. Plain arithmetic over torch_rkv's layouts, no vLLM: `python -m torch_rkv plan --vllm`
and the main suite use it, the backend publishes content_bytes from here, and tests/in_vllm checks the
token counts against the ones vLLM logs ("KV cache size: N tokens, Maximum concurrency ...").

vLLM 0.32 (v1/core/kv_cache_utils.py) cuts its KV memory into blocks of `block_size` tokens and sizes
the groups of layers that share a block table:
- Every layer attends to the whole context (or every one to the same sliding window): one group. A
  block is a page of every layer (under a per-layer allocation each layer's page has its own bytes,
  UniformTypeKVCacheSpecs), blocks = memory // (the sum of the pages).
- Sliding layers beside full ones (Gemma 2, 3 and 4, gpt-oss; the hybrid KV-cache manager): a bucket of
  layers per window (full: none), each cut into groups of `g` layers, g the smallest bucket's size
  (the largest's when it has under 1.5x as many), a bucket's last group short by its padding layers
  (_get_kv_cache_groups_uniform_page_size). A block is `g` pages, and every group draws its block
  table from the one pool. Pages of unequal bytes (Gemma 4's global layers of their own KV heads and
  head_dim) are brought to the largest first (unify_kv_cache_spec_page_size): a page that divides it
  holds that many times the tokens a block, any other is padded to it.
- A hybrid's recurrent layers (Qwen3-Next, Granite 4, Falcon-H1, Nemotron-H: vLLM's Mamba specs) form a
  bucket of their own. vLLM grows the block size until one attention page holds a layer's state
  (Platform._align_hybrid_block_size: in steps of the backend's smallest kernel block, at least the block
  size) and pads the state's page to the attention page.
A request of L tokens takes, per group, ceil(L / tokens a block) blocks if full, and if sliding over W
tokens ceil(min(W - 1 + in-flight tokens, L) / tokens a block) + 1: vLLM frees a block only once the
tokens scheduled after it have been computed (SlidingWindowSpec.max_admission_blocks_per_request).
A recurrent group takes 1 block (and 1 a speculative draft); with prefix caching (vLLM's default:
mamba_cache_mode "align") 2, and 1 more for a Mamba 2 mixer's prefill checkpoint (MambaSpec).
The engine runs blocks / (the sum over groups) such requests at once ("maximum concurrency") and logs
int(concurrency x L) tokens as its KV cache size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..layout import PageLayout, round_up, side_bytes
from ..scheme import Scheme
from .vllm_slots import INITIAL_SLOTS, pool_slots, slot_limit

# vLLM's default block sizes: on CPU platforms/cpu.py's, on CUDA CacheConfig.DEFAULT_BLOCK_SIZE
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}
# the smallest kernel block of vLLM's own attention backends (CPU_ATTN's multiples of 32; FlashAttention 2/3's and
# FlashInfer's 16: H100, A100), to which a hybrid's block size is aligned. (On Blackwell, FlashAttention 4's
# head_dim-256 kernel takes pages of 128 tokens: vLLM would round a planned block up to a multiple of that.)
OWN_KERNEL_BLOCK = {"cpu": 32, "cuda": 16}


def hybrid_block_size(block_size: int, token_bytes: int, kernel_block: int, state_bytes: int) -> int:
    """The block size vLLM runs a hybrid model with (Platform._align_hybrid_block_size): the least multiple of
    max(kernel_block, block_size) whose attention page (token_bytes a token, one layer) holds a recurrent
    layer's state of state_bytes, if that is more than block_size."""
    align = max(kernel_block, block_size)
    return max(block_size, align * -(-state_bytes // (align * token_bytes)))


def content_bytes(scheme: Scheme, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes per token of one layer's page (every KV head) in `scheme`, rounded up to the cache dtype:
    vLLM's page is block_size x this, which holds PageLayout's page of block_size tokens for every block
    size that is a multiple of the scheme's block (the per-block metadata is amortized over the block)."""
    page = round_up(16, scheme.block)
    per_token = -(-PageLayout(scheme, kv_heads, head_dim, page, dtype).page_bytes // page)
    return round_up(per_token, dtype.itemsize)


# vLLM pads a page that is not a whole fraction of the largest page up to it (unify_kv_cache_spec_page_size). rkv's
# bytes a token are not proportional to KV heads x head_dim (each head's value rows keep their own scale), so
# Gemma 4's sliding and global pages, twice each other in elements, miss the ratio by a few percent and the
# smaller were padded by about half. The plugin publishes instead pages that divide a largest page grown by
# at most this fraction of it (published_token_bytes).
PAGE_ROUNDING = 1 / 8


def published_token_bytes(natural: dict, layers: dict, align: int) -> dict:
    """The bytes a token the plugin publishes for each kind of page (natural: a kind's own bytes a token,
    content_bytes; layers: how many layers keep it) where vLLM brings pages of several sizes to the largest:
    each a whole fraction of one page size, which is the largest natural one grown by at most PAGE_ROUNDING,
    chosen for the least waste relative to each layer's own bytes, summed over layers (then the smaller).
    A kind no fraction fits is published at that size (vLLM's own padding). Every size a multiple of align
    (the cache dtype's bytes)."""
    top = max(natural.values())

    def fit(total: int) -> dict:
        out = {}
        for kind, own in natural.items():
            parts = total // own
            while parts > 1 and (total % parts or total // parts % align):
                parts -= 1
            out[kind] = total // parts
        return out

    sizes = {top} | {own * -(-top // own) for own in natural.values()}
    sizes = [t for t in sizes if t <= top * (1 + PAGE_ROUNDING) and t % align == 0]
    best = min(sizes, key=lambda t: (sum(layers[k] * (p - natural[k]) / natural[k] for k, p in fit(t).items()), t))
    return fit(best)


def block_multiple(scheme: Scheme) -> int:
    """The block sizes the plugin takes with this scheme are multiples of this: a page holds whole
    quantization blocks, and at least vLLM's 16 tokens."""
    return max(16, scheme.block)


def preferred_block_size(scheme: Scheme | None, device: str) -> int:
    """The block size vLLM runs a backend with. On CUDA, AttentionBackend.get_preferred_block_size: the
    default when the backend takes it, else the smallest it takes. On CPU vLLM sets 128 whatever the
    backend (a scheme whose pages cannot hold it is refused: VllmPool). scheme None: vLLM's own
    backends, which take the default."""
    default = DEFAULT_BLOCK_SIZE[device]
    if device == "cpu" or scheme is None or default % block_multiple(scheme) == 0:
        return default
    return block_multiple(scheme)


def slot_bytes(scheme: Scheme, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, drafts: int = 0) -> int:
    """One request's side slot over `layers` layers: its sinks and window ring, keys and values, and the
    plugin's sink store entry (drafts: speculative tokens a step may append, layout.side_shapes)."""
    return layers * side_bytes(scheme, kv_heads, head_dim, dtype, drafts, sink_store=True)


@dataclass(frozen=True)
class VllmPool:
    """One engine's KV pool: `layers` attention layers of `kv_heads` x `head_dim`, the model in `dtype`,
    blocks of `block_size` tokens. schemes: each layer's torch_rkv scheme (the plugin; each layer's page
    has its scheme's bytes), or None: vLLM's own cache, its elements in `cache_dtype` (None: the model
    dtype, "auto"; torch.float8_e4m3fn: --kv-cache-dtype fp8). shapes: each layer's (KV heads, head_dim)
    where they differ between layers (Gemma 4's global layers; None: kv_heads x head_dim in every one;
    layers that share another's cache have no page and are not among them). windows: each layer's
    sliding window in tokens, 0 for a layer that attends to the whole context (None: no layer slides);
    in_flight_tokens: what the engine schedules before the step that frees a sliding layer's blocks
    settles (max_num_batched_tokens x the batches in flight; VllmEngine); drafts: speculative tokens a
    step may append (each side slot's ring holds that many more rows)."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    schemes: tuple[Scheme, ...] | None = None
    block_size: int = DEFAULT_BLOCK_SIZE["cpu"]
    windows: tuple[int, ...] | None = None
    in_flight_tokens: int = 0
    drafts: int = 0
    cache_dtype: torch.dtype | None = None
    shapes: tuple[tuple[int, int], ...] | None = None
    # a hybrid's recurrent layers: how many, one layer's state a request (vLLM's layout,
    # RecurrentState.vllm_bytes) and the blocks a request holds in each of their groups
    states: int = 0
    state_bytes: int = 0
    state_blocks: int = 0

    def __post_init__(self):
        if self.cache_dtype is not None and self.schemes is not None:
            raise ValueError("VllmPool: cache_dtype is vLLM's own cache's; the plugin's pages follow their schemes")
        if self.schemes is not None and len(self.schemes) != self.layers:
            raise ValueError(f"VllmPool: {len(self.schemes)} schemes for {self.layers} layers")
        for name, per_layer in (("windows", self.windows), ("shapes", self.shapes)):
            if per_layer is not None and len(per_layer) != self.layers:
                raise ValueError(f"VllmPool: {len(per_layer)} {name} for {self.layers} layers")
        for s in self.schemes or ():
            if self.block_size % block_multiple(s):
                raise ValueError(f"VllmPool: block_size {self.block_size} is not a multiple of "
                                 f"{block_multiple(s)} tokens, which {s.name}'s pages need")
        if self.states and (len(set(self.natural_pages)) > 1 or self.layer_pages[0] < self.state_bytes):
            raise ValueError(f"VllmPool: a hybrid's recurrent states ({self.state_bytes} bytes) take pages of one "
                             f"attention page's bytes, which must be one size and hold them (pages "
                             f"{sorted(set(self.layer_pages))} of block_size {self.block_size}: hybrid_block_size)")
        for window, layers in self.buckets.items():
            if window is not None and len({self.natural_pages[i] for i in layers}) > 1 and len(self.buckets) > 1:
                # vLLM then gives each page size a spec, and so a bucket, of its own: not modelled here
                raise ValueError(f"VllmPool: layers of one {'window' if window else 'full context'} keep pages of "
                                 f"different bytes ({sorted({self.natural_pages[i] for i in layers})}) beside "
                                 "layers of another window; plan one key + value total in every layer (a split) "
                                 "for such a model")

    @cached_property
    def layer_shapes(self) -> tuple[tuple[int, int], ...]:
        """Each layer's (KV heads, head_dim)."""
        return self.shapes if self.shapes is not None else ((self.kv_heads, self.head_dim),) * self.layers

    @cached_property
    def buckets(self) -> dict[int | None, list[int]]:
        """The layers of each window (0: full; None: a hybrid's recurrent layers, numbered from `layers` on)."""
        buckets: dict[int | None, list[int]] = {}
        for i in range(self.layers):
            buckets.setdefault(self.window(i), []).append(i)
        if self.states:
            buckets[None] = list(range(self.layers, self.layers + self.states))
        return buckets

    @cached_property  # (a frozen dataclass: computed once; content_bytes walks every layer's layout)
    def natural_pages(self) -> tuple[int, ...]:
        """Each layer's page as its layer publishes it: block_size tokens of every KV head; with one scheme where
        layers of several windows share the pool, the plugin's pages of each shape whole fractions of one size
        (published_token_bytes; the plugin does not round an allocation's pages, and plan refuses an
        allocation on layers of two shapes)."""
        shapes = self.layer_shapes
        if self.schemes is None:
            element = (self.cache_dtype or self.dtype).itemsize
            return tuple(self.block_size * 2 * h * d * element for h, d in shapes)
        per_token = {(s, *shape): content_bytes(s, *shape, self.dtype) for s, shape in zip(self.schemes, shapes)}
        if len(set(self.schemes)) == 1 and len(self.buckets) > 1 and len(per_token) > 1:
            count = {kind: sum((s, *shape) == kind for s, shape in zip(self.schemes, shapes)) for kind in per_token}
            per_token = published_token_bytes(per_token, count, self.dtype.itemsize)
        return tuple(self.block_size * per_token[(s, *shape)] for s, shape in zip(self.schemes, shapes))

    @cached_property
    def layer_pages(self) -> tuple[int, ...]:
        """Each layer's page in the pool: its natural page; where several groups draw blocks from the pool,
        the largest page (unify_kv_cache_spec_page_size: a smaller one holds more tokens or is padded)."""
        if len(self.buckets) == 1:
            return self.natural_pages
        return (max(self.natural_pages),) * self.layers

    @cached_property
    def layer_tokens(self) -> tuple[int, ...]:
        """The tokens a block of each layer holds: block_size, times the ratio where its natural page divides its
        page in the pool (else it is padded)."""
        return tuple(self.block_size * (page // natural if page % natural == 0 else 1)
                     for page, natural in zip(self.layer_pages, self.natural_pages))

    def window(self, layer: int) -> int:
        return 0 if self.windows is None else self.windows[layer]

    def page(self, layer: int) -> int:
        """A layer's page; the recurrent layers (indices from `layers` on) the attention page they are padded to."""
        return self.layer_pages[layer] if layer < self.layers else self.layer_pages[0]

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """vLLM's KV-cache groups, as layer indices: one per window bucket (and the recurrent layers', numbered
        from `layers` on) and run of g layers."""
        if len(self.buckets) == 1:
            return (tuple(range(self.layers)),)
        sizes = [len(b) for b in self.buckets.values()]
        g = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
        groups = []
        for layers in self.buckets.values():
            n = -(-len(layers) // g)
            groups += [tuple(layers[i::n]) for i in range(n)]
        return tuple(groups)

    @property
    def block_bytes(self) -> int:
        """One block: the widest group's pages, what vLLM divides its KV memory by."""
        return max(sum(self.page(i) for i in group) for group in self.groups)

    def blocks(self, kv_bytes: float) -> int:
        """Blocks in `kv_bytes` of KV memory."""
        return int(kv_bytes // self.block_bytes)

    def window_blocks(self, window: int, max_model_len: int, tokens: int | None = None) -> int:
        """The blocks a request of max_model_len tokens holds at most in a group of this window (0: full) whose
        blocks hold `tokens` tokens (None: block_size)."""
        tokens = tokens or self.block_size
        if window == 0:
            return -(-max_model_len // tokens)
        return -(-min(window - 1 + self.in_flight_tokens, max_model_len) // tokens) + 1

    def request_blocks(self, max_model_len: int) -> int:
        """The blocks a request of max_model_len tokens takes at most, over every group."""
        return sum(self.state_blocks if group[0] >= self.layers else
                   self.window_blocks(self.window(group[0]), max_model_len, self.layer_tokens[group[0]])
                   for group in self.groups)

    def layer_rows(self, max_model_len: int) -> list[int]:
        """The token rows each layer's pages hold for such a request."""
        return [self.window_blocks(self.window(i), max_model_len, self.layer_tokens[i]) * self.layer_tokens[i]
                for i in range(self.layers)]

    def capacity(self, kv_bytes: float, max_model_len: int) -> tuple[int, float]:
        """(KV cache size in tokens, maximum concurrency for requests of max_model_len tokens), as vLLM
        logs them for `kv_bytes` of KV memory."""
        concurrency = self.blocks(kv_bytes) / self.request_blocks(max_model_len)
        return int(concurrency * max_model_len), concurrency

    def pages_bytes(self, context: int, requests: int) -> int:
        """KV memory `requests` requests of `context` tokens take at once: their blocks, whole."""
        return requests * self.request_blocks(context) * self.block_bytes

    @property
    def slot_bytes(self) -> int:
        """The side pool's bytes per request slot, every layer (0 for vLLM's own cache)."""
        if self.schemes is None:
            return 0
        shapes = self.layer_shapes
        return sum(slot_bytes(self.schemes[0], shapes.count(shape), *shape, self.dtype, self.drafts)
                   for shape in set(shapes))

    def side_bytes(self, running: int, max_num_seqs: int) -> int:
        """The side pool's bytes at most, while at most `running` requests run at once (pool_slots)."""
        return pool_slots(running, slot_limit(max_num_seqs), INITIAL_SLOTS) * self.slot_bytes
