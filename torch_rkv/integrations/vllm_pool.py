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
- Sliding layers beside full ones (Gemma 2 and 3, gpt-oss; the hybrid KV-cache manager): a bucket of
  layers per window (full: none), each cut into groups of `g` layers, g the smallest bucket's size
  (the largest's when it has under 1.5x as many), a bucket's last group short by its padding layers
  (_get_kv_cache_groups_uniform_page_size). A block is `g` pages, and every group draws its block
  table from the one pool.
- A hybrid's recurrent layers (Qwen3-Next, Granite 4, Falcon-H1, Nemotron-H: vLLM's Mamba specs) form a
  bucket of their own. vLLM grows the block size until one attention page holds a layer's state
  (Platform._align_hybrid_block_size: in steps of the backend's smallest kernel block, at least the block
  size) and pads the state's page to the attention page.
A request of L tokens takes, per group, ceil(L / block_size) blocks if full, and if sliding over W
tokens ceil(min(W - 1 + in-flight tokens, L) / block_size) + 1: vLLM frees a block only once the
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
    """One request's side slot over `layers` layers: its sinks and window ring, keys and values (drafts:
    speculative tokens a step may append, layout.side_shapes)."""
    return layers * side_bytes(scheme, kv_heads, head_dim, dtype, drafts)


@dataclass(frozen=True)
class VllmPool:
    """One engine's KV pool: `layers` attention layers of `kv_heads` x `head_dim`, the model in `dtype`,
    blocks of `block_size` tokens. schemes: each layer's torch_rkv scheme (the plugin; each layer's page
    has its scheme's bytes), or None: vLLM's own cache, its elements in `cache_dtype` (None: the model
    dtype, "auto"; torch.float8_e4m3fn: --kv-cache-dtype fp8). windows: each layer's
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
        if self.windows is not None and len(self.windows) != self.layers:
            raise ValueError(f"VllmPool: {len(self.windows)} windows for {self.layers} layers")
        for s in self.schemes or ():
            if self.block_size % block_multiple(s):
                raise ValueError(f"VllmPool: block_size {self.block_size} is not a multiple of "
                                 f"{block_multiple(s)} tokens, which {s.name}'s pages need")
        if self.states and (len(set(self.layer_pages)) > 1 or self.layer_pages[0] < self.state_bytes):
            raise ValueError(f"VllmPool: a hybrid's recurrent states ({self.state_bytes} bytes) take pages of one "
                             f"attention page's bytes, which must be one size and hold them (pages "
                             f"{sorted(set(self.layer_pages))} of block_size {self.block_size}: hybrid_block_size)")
        if len(self.groups) > 1 and len(set(self.layer_pages)) > 1:
            # vLLM then pads every smaller page to the largest (or, where it divides it, takes more
            # tokens a block in that layer's group): neither is modelled here
            raise ValueError("VllmPool: the layers attend to different windows and their pages differ in bytes "
                             f"({sorted(set(self.layer_pages))}), which vLLM brings to one size by padding; plan "
                             "one key + value total in every layer (a split) for such a model")

    @cached_property  # (a frozen dataclass: computed once; content_bytes walks every layer's layout)
    def layer_pages(self) -> tuple[int, ...]:
        """Each layer's page: block_size tokens of every KV head."""
        if self.schemes is None:
            element = (self.cache_dtype or self.dtype).itemsize
            return (self.block_size * 2 * self.kv_heads * self.head_dim * element,) * self.layers
        per_token = {s: content_bytes(s, self.kv_heads, self.head_dim, self.dtype) for s in set(self.schemes)}
        return tuple(self.block_size * per_token[s] for s in self.schemes)

    def window(self, layer: int) -> int:
        return 0 if self.windows is None else self.windows[layer]

    def page(self, layer: int) -> int:
        """A layer's page; the recurrent layers (indices from `layers` on) the attention page they are padded to."""
        return self.layer_pages[layer] if layer < self.layers else self.layer_pages[0]

    @cached_property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """vLLM's KV-cache groups, as layer indices: one per window bucket (and the recurrent layers', numbered
        from `layers` on) and run of g layers."""
        buckets: dict[int | None, list[int]] = {}  # window (None: recurrent) -> its layers
        for i in range(self.layers):
            buckets.setdefault(self.window(i), []).append(i)
        if self.states:
            buckets[None] = list(range(self.layers, self.layers + self.states))
        if len(buckets) == 1:
            return (tuple(range(self.layers)),)
        sizes = [len(b) for b in buckets.values()]
        g = max(sizes) if max(sizes) < min(sizes) * 1.5 else min(sizes)
        groups = []
        for layers in buckets.values():
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

    def window_blocks(self, window: int, max_model_len: int) -> int:
        """The blocks a request of max_model_len tokens holds at most in a group of this window (0: full)."""
        if window == 0:
            return -(-max_model_len // self.block_size)
        return -(-min(window - 1 + self.in_flight_tokens, max_model_len) // self.block_size) + 1

    def request_blocks(self, max_model_len: int) -> int:
        """The blocks a request of max_model_len tokens takes at most, over every group."""
        return sum(self.state_blocks if group[0] >= self.layers else
                   self.window_blocks(self.window(group[0]), max_model_len) for group in self.groups)

    def layer_rows(self, max_model_len: int) -> list[int]:
        """The token rows each layer's pages hold for such a request."""
        return [self.window_blocks(self.window(i), max_model_len) * self.block_size for i in range(self.layers)]

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
        return slot_bytes(self.schemes[0], self.layers, self.kv_heads, self.head_dim, self.dtype, self.drafts)

    def side_bytes(self, running: int, max_num_seqs: int) -> int:
        """The side pool's bytes at most, while at most `running` requests run at once (pool_slots)."""
        return pool_slots(running, slot_limit(max_num_seqs), INITIAL_SLOTS) * self.slot_bytes
