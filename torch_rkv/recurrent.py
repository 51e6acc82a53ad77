"""The fixed-size state a hybrid model's recurrent layer keeps per sequence, beside the attention layers' KV
caches, as transformers' mixers allocate it (LinearAttentionLayer's conv_states and recurrent_states).

It does not grow with the context, but every sequence holds one per recurrent layer: for Qwen3-Next-80B, 36
gated-DeltaNet layers of 2.1 MB each, 78 MB a sequence, 15% of what a 128K-token sequence holds at rkv-2. The
planner adds it to every row. Shapes are the mixers' own (each family names its dimensions in keys of its own),
so only the families below are known; tests/test_families_hybrid.py checks each against the states a forward allocates.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class RecurrentState:
    """One layer's state for one sequence: a causal convolution's window over `channels` inputs of `kernel`
    taps, and a recurrent state (an SSM's or the delta rule's) of `heads` x `head_state` elements. Mamba 2's
    convolution also reads `groups` groups of B and C (`group_channels`, 2 x d_state, each), which vLLM
    replicates where tensor-parallel ranks outnumber them. `mixer` names the kind."""

    mixer: str  # "gated_delta_net", "mamba", "mamba2", "short_conv"
    channels: int
    kernel: int
    heads: int = 0
    head_state: int = 0
    groups: int = 0
    group_channels: int = 0
    # the SSM state dtype the model's config asks vLLM for ("auto": the model dtype; Nemotron-H's config
    # mamba_ssm_cache_dtype, float32 by default: vLLM's NemotronHForCausalLMConfig)
    vllm_ssm_dtype: str = "auto"

    @property
    def conv(self) -> int:
        """transformers' convolution window, in elements: every kernel tap."""
        return self.channels * self.kernel

    @property
    def recurrent(self) -> int:
        return self.heads * self.head_state

    def nbytes(self, dtype: torch.dtype) -> int:
        """transformers' layout: the window in the model dtype, the recurrent state in float32 (the mixers
        compute it in float32)."""
        size = torch.finfo(dtype).bits // 8
        return self.conv * size + self.recurrent * max(size, 4)

    def vllm_bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype, ranks: int = 1, drafts: int = 0) -> int:
        """vLLM 0.32's layout on one of `ranks` tensor-parallel ranks (MambaStateShapeCalculator): the
        window keeps kernel - 1 taps and one more per speculative draft, in conv_dtype; the channels and
        heads are sharded over the ranks, Mamba 2's one group first replicated to each rank (more groups must
        divide among them)."""
        if self.groups > 1 and self.groups % ranks:  # (MambaMixer2 asserts it: one group, or a multiple)
            raise ValueError(f"plan --vllm: {ranks} tensor-parallel ranks (--tensor-parallel-size) do not divide a "
                             f"{self.mixer} layer's {self.groups} groups (n_groups), which vLLM takes only when there "
                             "is one")
        groups = ranks if self.groups == 1 else self.groups
        channels = self.channels + (groups - self.groups) * self.group_channels
        if channels % ranks or self.heads % ranks:
            raise ValueError(f"plan --vllm: {ranks} tensor-parallel ranks (--tensor-parallel-size) do not divide a "
                             f"{self.mixer} layer's {channels} convolution channels and {self.heads} heads, as vLLM "
                             "shards them")
        conv = channels // ranks * (self.kernel - 1 + drafts)
        return conv * conv_dtype.itemsize + self.heads // ranks * self.head_state * ssm_dtype.itemsize


def _gated_delta_net(c) -> RecurrentState:
    # a convolution over the concatenated q, k, v projections; a key_dim x value_dim state per value head
    conv = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    return RecurrentState("gated_delta_net", conv, c.linear_conv_kernel_dim, c.linear_num_value_heads,
                          c.linear_key_head_dim * c.linear_value_head_dim)


def _mamba(c) -> RecurrentState:
    # Mamba 1: a convolution over the expanded channels, d_state per channel
    inner = c.mamba_expand * c.hidden_size
    return RecurrentState("mamba", inner, c.mamba_d_conv, inner, c.mamba_d_state)


def _mamba2(inner: int, heads: int, head_dim: int, groups: int, d_state: int, kernel: int) -> RecurrentState:
    # Mamba 2: a convolution over x, B and C (groups x d_state each); a head_dim x d_state state per head
    return RecurrentState("mamba2", inner + 2 * groups * d_state, kernel, heads, head_dim * d_state, groups,
                          2 * d_state)


def _mamba2_named(c, inner: int | None = None) -> RecurrentState:
    # Bamba's, Granite 4's and Falcon-H1's names (Falcon-H1 may set the inner width, mamba_d_ssm)
    return _mamba2(inner or int(c.mamba_expand * c.hidden_size), c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups,
                   c.mamba_d_state, c.mamba_d_conv)


def _short_conv(c) -> RecurrentState:
    # LFM2: a gated convolution over the hidden state, no recurrence
    return RecurrentState("short_conv", c.hidden_size, c.conv_L_cache)


# model_type (of the text config) -> one recurrent layer's state; a family's recurrent layers share one mixer
MIXERS = {
    "qwen3_next": _gated_delta_net,
    "qwen3_5_text": _gated_delta_net,
    "qwen3_5_moe_text": _gated_delta_net,
    "olmo_hybrid": _gated_delta_net,
    "lara_mini": _gated_delta_net,
    "jamba": _mamba,
    "bamba": _mamba2_named,
    "granitemoehybrid": _mamba2_named,
    "falcon_h1": lambda c: _mamba2_named(c, c.mamba_d_ssm),
    "nemotron_h": lambda c: replace(_mamba2(c.mamba_num_heads * c.mamba_head_dim, c.mamba_num_heads,
                                            c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel),
                                    vllm_ssm_dtype=getattr(c, "mamba_ssm_cache_dtype", None) or "float32"),
    "lfm2": _short_conv,
    "lfm2_moe": _short_conv,
}


# the config keys the mixers' shapes are read from (a config that overrides them per layer has several shapes)
STATE_KEYS = ("hidden_size", "conv_L_cache", "n_groups", "ssm_state_size", "conv_kernel")
STATE_KEY_PREFIXES = ("linear_", "mamba_")


def reads(key: str) -> bool:
    """Whether some family's state shape is read from config key `key`."""
    return key in STATE_KEYS or key.startswith(STATE_KEY_PREFIXES)


def state_of(config) -> RecurrentState | None:
    """One recurrent layer's state per sequence, for a transformers text config; None for a family whose
    mixers are not known here (the caller says it is not counted)."""
    mixer = MIXERS.get(getattr(config, "model_type", None))
    return mixer(config) if mixer else None
