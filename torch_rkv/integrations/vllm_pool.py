"""What a vLLM engine holds in a given memory, with the plugin or with its own cache: vLLM's KV pages,
sized from the bytes each page publishes (content_bytes), and the plugin's side pool of full-precision
rows beside them. Plain arithmetic over torch_rkv's layouts, no vLLM: `python -m torch_rkv plan --vllm`
and the main suite use it, the backend publishes content_bytes from here, and tests/in_vllm checks the
token counts against the ones vLLM logs ("KV cache size: N tokens, Maximum concurrency ...").

vLLM 0.32 (v1/core/kv_cache_utils.py) cuts its KV memory into blocks of `block_size` tokens of every
layer: blocks = memory // (the sum of the layers' page bytes; under a per-layer allocation each layer's
page has its own bytes, UniformTypeKVCacheSpecs). A request of L tokens takes ceil(L / block_size) of
them, so the engine runs blocks / ceil(L / block_size) such requests at once ("maximum concurrency"),
and logs int(concurrency x L) tokens as its KV cache size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..layout import PageLayout, round_up
from ..scheme import Scheme
from .vllm_slots import INITIAL_SLOTS, pool_slots, slot_limit

# vLLM's default block sizes: on CPU platforms/cpu.py's, on CUDA CacheConfig.DEFAULT_BLOCK_SIZE
DEFAULT_BLOCK_SIZE = {"cpu": 128, "cuda": 16}


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


def slot_bytes(scheme: Scheme, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """One request's side slot over `layers` layers: its sinks and window ring, keys and values."""
    return layers * PageLayout(scheme, kv_heads, head_dim, scheme.block, dtype).slot_bytes


@dataclass(frozen=True)
class VllmPool:
    """One engine's KV pool: `layers` attention layers (none sliding) of `kv_heads` x `head_dim`, the
    model in `dtype`, blocks of `block_size` tokens. schemes: each layer's torch_rkv scheme (the plugin;
    each layer's page has its scheme's bytes), or None: vLLM's own cache in the model dtype ("auto")."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    schemes: tuple[Scheme, ...] | None = None
    block_size: int = DEFAULT_BLOCK_SIZE["cpu"]

    def __post_init__(self):
        if self.schemes is not None and len(self.schemes) != self.layers:
            raise ValueError(f"VllmPool: {len(self.schemes)} schemes for {self.layers} layers")
        for s in self.schemes or ():
            if self.block_size % block_multiple(s):
                raise ValueError(f"VllmPool: block_size {self.block_size} is not a multiple of "
                                 f"{block_multiple(s)} tokens, which {s.name}'s pages need")

    @cached_property  # (a frozen dataclass: computed once; content_bytes walks every layer's layout)
    def layer_pages(self) -> tuple[int, ...]:
        """Each layer's page: block_size tokens of every KV head."""
        if self.schemes is None:
            return (self.block_size * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize,) * self.layers
        per_token = {s: content_bytes(s, self.kv_heads, self.head_dim, self.dtype) for s in set(self.schemes)}
        return tuple(self.block_size * per_token[s] for s in self.schemes)

    @property
    def block_bytes(self) -> int:
        """One block of every layer: what vLLM divides its KV memory by."""
        return sum(self.layer_pages)

    def blocks(self, kv_bytes: float) -> int:
        """Blocks (of every layer) in `kv_bytes` of KV memory."""
        return int(kv_bytes // self.block_bytes)

    def capacity(self, kv_bytes: float, max_model_len: int) -> tuple[int, float]:
        """(KV cache size in tokens, maximum concurrency for requests of max_model_len tokens), as vLLM
        logs them for `kv_bytes` of KV memory."""
        concurrency = self.blocks(kv_bytes) / -(-max_model_len // self.block_size)
        return int(concurrency * max_model_len), concurrency

    def pages_bytes(self, context: int, requests: int) -> int:
        """KV memory `requests` requests of `context` tokens take at once: their blocks, whole."""
        return requests * -(-context // self.block_size) * self.block_bytes

    @property
    def slot_bytes(self) -> int:
        """The side pool's bytes per request slot, every layer (0 for vLLM's own cache)."""
        if self.schemes is None:
            return 0
        return slot_bytes(self.schemes[0], self.layers, self.kv_heads, self.head_dim, self.dtype)

    def side_bytes(self, running: int, max_num_seqs: int) -> int:
        """The side pool's bytes at most, while at most `running` requests run at once (pool_slots)."""
        return pool_slots(running, slot_limit(max_num_seqs), INITIAL_SLOTS) * self.slot_bytes
