"""A vLLM engine with the plugin (integrations/vllm_pool.py): VllmEngine, how the engine runs and the pool of KV
pages, side rows and recurrent states it keeps for a model, and vllm_row, what such an engine holds in a
budget with each scheme (the KV memory to give vLLM, and the tokens and concurrency vLLM logs for it)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..integrations.vllm import VLLM_HYBRIDS
from ..integrations.vllm_pool import OWN_KERNEL_BLOCK, VllmPool, block_multiple, hybrid_block_size, preferred_block_size
from ..integrations.vllm_slots import check_drafts
from ..recurrent import RecurrentState
from ..scheme import Scheme
from .shape import ModelShape

# vLLM's own caches, by the --kv-cache-dtype that serves them: the model dtype, and 8-bit floats (per-tensor
# scales: 1.0 unless the checkpoint carries calibrated ones; on CPU vLLM needs AVX-512 or AMX for them)
VLLM_CACHES = {"auto": None, "fp8": torch.float8_e4m3fn}

# vllm serve's max_num_batched_tokens (engine/arg_utils.py get_batch_defaults, one GPU or CPU socket):
# on GPUs by their memory (A100s aside, which keep the smallest), on CPUs 2048
SERVE_BATCHED_TOKENS = ((160 * 2**30, 16384), (70 * 2**30, 8192), (0, 2048))


@dataclass(frozen=True)
class VllmEngine:
    """How the engine runs: the model dtype (vLLM's own cache and the side rows), the device ("cuda" or
    "cpu": its default block size), the block size (None: the one vLLM picks for the backend),
    max_num_seqs (the side pool's limit), max_num_batched_tokens (what a sliding layer holds beyond its
    window) and the hybrid KV-cache manager (vLLM's default; off, every sliding layer keeps every block
    of its requests, like a full one)."""

    dtype: torch.dtype = torch.bfloat16
    device: str = "cuda"
    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    hybrid: bool = True
    tensor_parallel: int = 1
    speculative_tokens: int = 0  # ngram speculative decoding's num_speculative_tokens
    prefix_caching: bool = True  # (vLLM's default; a hybrid's recurrent states then take more blocks a request)
    ssm_dtype: str = "auto"  # vLLM's --mamba-ssm-cache-dtype

    def rank(self, model: ModelShape) -> ModelShape:
        """What one GPU of the engine holds of the model: tensor parallelism shards the KV heads evenly,
        and gives every rank one when there are fewer heads than ranks (each head on tp / heads ranks:
        vLLM's QKVParallelLinear), so the pages and side rows of a rank are the model's with that many
        heads (Gemma 4's global layers' heads too). vLLM logs the engine's capacity, which is every rank's
        (each holds its heads of every token)."""
        tp = self.tensor_parallel

        def shard(heads: int) -> int:
            if tp < 1 or (heads % tp if tp <= heads else tp % heads):
                raise ValueError(f"plan --vllm: --tensor-parallel-size {tp} neither divides {model.name}'s {heads} "
                                 "KV heads nor is a multiple of them, which vLLM needs to shard or replicate them")
            return max(1, heads // tp)

        glob = model.global_shape and (shard(model.global_shape[0]), model.global_shape[1])
        return replace(model, kv_heads=shard(model.kv_heads), global_shape=glob)

    def block_for(self, scheme: Scheme | None) -> int:
        """The block size the engine runs with this scheme (every layer's: an allocation's share it)."""
        return self.block_size or preferred_block_size(scheme, self.device)

    @property
    def async_scheduling(self) -> bool:
        """vLLM's default: on CUDA, unless ngram speculative decoding turns it off; never on CPU
        (platforms/cpu.py)."""
        return self.device == "cuda" and not self.speculative_tokens

    @property
    def in_flight_tokens(self) -> int:
        """Tokens scheduled before a step's blocks are freed: async scheduling runs one batch ahead."""
        return self.max_num_batched_tokens * (2 if self.async_scheduling else 1)

    def windows(self, model: ModelShape) -> tuple[int, ...] | None:
        """Each layer's sliding window as vLLM's KV-cache manager sees it (None: none slides). Without the
        hybrid manager, vLLM gives sliding layers beside full ones a full layer's blocks
        (_promote_local_kv_cache_specs); a model whose layers all slide keeps its windows."""
        if not model.sliding_layers or (not self.hybrid and model.full_layers):
            return None
        return tuple(model.window_of(i) for i in range(model.layers))

    def pads_unequal_pages(self, model: ModelShape) -> bool:
        """Whether vLLM groups the model's layers by window (sliding beside full layers), where it pads
        pages of unequal bytes to the largest: an allocation then keeps one total in every layer."""
        return len(set(self.windows(model) or ())) > 1

    def pool(self, model: ModelShape, schemes: list[Scheme] | None, cache_dtype: torch.dtype | None = None
             ) -> VllmPool:
        """The engine's pool with the plugin (`schemes`, one a layer) or vLLM's own cache (None) in
        cache_dtype (None: the model dtype)."""
        # (KV-shared layers get no pages from vLLM: model.layers are the ones that keep a cache)
        shapes = tuple(map(model.shape_of, range(model.layers))) if model.global_shape else None
        block = self.block_for(schemes[0] if schemes else None)
        pool = VllmPool(model.layers, model.kv_heads, model.head_dim, self.dtype,
                        None if schemes is None else tuple(schemes), block, self.windows(model),
                        self.in_flight_tokens, self.speculative_tokens, cache_dtype, shapes)
        if not model.recurrent_hybrid:
            return pool
        model.one_shape("plan --vllm (a hybrid's pool)")
        state = self.hybrid_state(model)
        drafts = self.speculative_tokens
        state_bytes = state.vllm_bytes(self.dtype, self.state_ssm_dtype(state), self.tensor_parallel, drafts)
        # (the plugin's kernel blocks: multiples of its block; an allocation on a hybrid is refused: one page)
        kernel = block_multiple(schemes[0]) if schemes else OWN_KERNEL_BLOCK[self.device]
        block = hybrid_block_size(block, pool.layer_pages[0] // block, kernel, state_bytes)
        blocks = 1 + drafts + (1 + (state.mixer == "mamba2") if self.prefix_caching else 0)
        return replace(pool, block_size=block, states=model.recurrent_layers, state_bytes=state_bytes,
                       state_blocks=blocks)

    def hybrid_state(self, model: ModelShape) -> RecurrentState:
        """A hybrid's recurrent layer, where the plugin serves its family and vLLM's pool is modelled: its
        recurrent layers each a Mamba spec of vLLM's, every other layer attention or an MLP alone."""
        if model.family not in VLLM_HYBRIDS:
            raise ValueError(f"plan --vllm: {model.name} is a hybrid of family {model.family or 'unknown'!r}; the "
                             f"plugin serves {', '.join(VLLM_HYBRIDS)} (give --config with such a model's config.json)")
        if model.state is None:
            raise ValueError(f"plan --vllm: {model.name}'s recurrent layers' state is unknown (its config was not "
                             "read by transformers' config class: install a transformers that knows "
                             f"{model.family!r})")
        return model.state

    def state_ssm_dtype(self, state: RecurrentState) -> torch.dtype:
        """The dtype vLLM keeps a recurrent state in: --mamba-ssm-cache-dtype, else the family's (Nemotron-H:
        float32), else the model dtype; on a CPU with AVX-512 BF16 (the one planning), float32 but for an
        explicit 16-bit dtype on gated DeltaNet (platforms/cpu.py: its accelerated kernels)."""
        name = self.ssm_dtype if self.ssm_dtype != "auto" else state.vllm_ssm_dtype
        if self.device == "cpu" and torch.cpu._is_avx512_bf16_supported() and name != "float32":
            if not (name in ("float16", "bfloat16") and state.mixer == "gated_delta_net"):
                name = "float32"
        return self.dtype if name == "auto" else getattr(torch, name)


def serve_batched_tokens(device: str, gpu_bytes: float, world_size: int = 1) -> int:
    """vllm serve's default max_num_batched_tokens on this device (SERVE_BATCHED_TOKENS; on CPU 2048
    a rank)."""
    if device == "cpu":
        return 2048 * world_size
    return next(tokens for least, tokens in SERVE_BATCHED_TOKENS if gpu_bytes >= least)


def vllm_bytes(model: ModelShape, engine: VllmEngine, schemes: list[Scheme] | None, context: int, batch: int) -> int:
    """Memory `batch` requests of `context` tokens take at once in a vLLM engine: their KV blocks, whole,
    and the plugin's side pool at its most for that many requests (VllmPool.side_bytes)."""
    pool = engine.pool(model, schemes)
    return pool.pages_bytes(context, batch) + pool.side_bytes(batch, engine.max_num_seqs)


def vllm_rows(model: ModelShape, engine: VllmEngine, budget: float, context: int, batch: int,
              schemes: list[tuple[str, Scheme | None]]) -> list[dict]:
    """Per scheme (None: vLLM's own cache of that name, VLLM_CACHES), vllm_row of every layer keeping it."""
    return [vllm_row(model, engine, budget, context, batch, name, None if scheme is None else [scheme] * model.layers)
            for name, scheme in schemes]


def vllm_row(model: ModelShape, engine: VllmEngine, budget: float, context: int, batch: int, name: str,
             schemes: list[Scheme] | None) -> dict:
    """What a vLLM engine holds in `budget` bytes with `batch` requests running at once, each layer
    keeping its scheme (None: vLLM's own cache `name`, VLLM_CACHES): the plugin's side pool for them
    comes first, and the rest is the KV memory to give vLLM (kv_cache_memory_bytes), whose tokens and
    concurrency for requests of `context` tokens are what vLLM logs."""
    for scheme in set(schemes or ()):
        scheme.check_served()
        check_drafts(scheme, engine.speculative_tokens)
    own = VLLM_CACHES[name] if schemes is None else None
    pool = engine.pool(model, schemes, own)
    side = pool.side_bytes(batch, engine.max_num_seqs)
    kv = max(0, int(budget) - side)
    tokens, concurrency = pool.capacity(kv, context)
    if schemes is None:
        bits = 8.0 * own.itemsize if own is not None else 16.0
    else:
        bits = sum(s.effective_bits(model.head_dim) for s in schemes) / len(schemes)
    return {"scheme": name, "bits_per_element": bits, "block_size": pool.block_size,
            "page_bytes": pool.layer_pages[0], "side_pool_bytes": side, "kv_cache_memory_bytes": kv,
            "kv_tokens": tokens, "max_concurrency": concurrency,
            "fits": concurrency >= batch and batch <= engine.max_num_seqs,
            "channels": schemes[0].channels if schemes and schemes[0].k_refine else None}
