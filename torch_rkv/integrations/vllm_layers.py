"""Which scheme and codebook rows each of vLLM's attention layers keeps: the plugin's one scheme
(TORCH_RKV_SCHEME), or a per-layer allocation's row (TORCH_RKV_ALLOCATION), found by vLLM's layer index."""

from __future__ import annotations

from vllm.model_executor.models.utils import extract_layer_index

from ..channels import channel_buffers
from ..codebook import SIDES
from ..scheme import Scheme
from .vllm import ALLOCATION_ENV, ENV, configured_layers, configured_scheme


def served_scheme() -> Scheme:
    """The scheme every layer's sinks, window and block follow (with an allocation: layer 0's, which
    every layer shares but for its bits)."""
    s = configured_scheme()
    if s is None:
        raise RuntimeError(f"torch_rkv's vLLM backend is in use but neither {ENV} nor {ALLOCATION_ENV} is set")
    s.check_served()
    return s


def layer_scheme(layer_name: str) -> Scheme:
    """The scheme of vLLM's layer `layer_name`: its row of the allocation, found by vLLM's layer index
    (the number in the layer's name: the model's own numbering, which the calibration uses), or the one
    scheme."""
    layers = configured_layers()
    if layers is None:
        return served_scheme()
    index = extract_layer_index(layer_name)
    if not 0 <= index < len(layers):
        raise ValueError(f"{ALLOCATION_ENV}: the allocation has {len(layers)} layers; vLLM's layer {layer_name} "
                         f"(index {index}) is not among them: it was made for another model")
    layers[index].check_served()
    return layers[index]


def refined_channels(scheme: Scheme, layer_name: str, kv_heads: int, head_dim: int):
    """The refined key channels (kv_heads, m) int32 of vLLM's layer `layer_name` (its rows of the scheme's
    ranking file, by vLLM's layer index), or None (none refined)."""
    index = extract_layer_index(layer_name)
    return channel_buffers([scheme], [index], kv_heads, head_dim, None, "torch_rkv's vLLM backend")["k_channels_0"]


def codebook_rows(scheme: Scheme, layer_name: str) -> tuple:
    """(k_levels, v_levels) of vLLM's layer `layer_name`: its rows of the scheme's codebook, found by vLLM's
    layer index (the number in the layer's name: the model's own numbering, which calibrate-levels uses),
    or None each (the uniform grid)."""
    if scheme.levels != "calibrated":
        return None, None
    index = extract_layer_index(layer_name)
    return tuple(scheme.side_levels(index, side) for side in SIDES)
