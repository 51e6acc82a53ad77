"""PNG plots of the report (matplotlib, headless)."""

from __future__ import annotations

import os
from collections import defaultdict

import torch


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def ppl_vs_bits(schemes: list[dict], fp_ppl: float, path: str) -> str:
    """Change in perplexity against effective bits, one line per scheme family."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    by_family = defaultdict(list)
    for row in schemes:
        by_family[row["family"]].append((row["bits_per_element"], row["ppl"] - fp_ppl))
    for family, pts in by_family.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [max(p[1], 1e-3) for p in pts], "o-", label=family)
    ax.set_yscale("log")
    ax.set_xlabel("effective bits per element (codes + metadata)")
    ax.set_ylabel("perplexity increase over full precision")
    ax.set_title(f"KV-cache quantization on the report model (full precision {fp_ppl:.2f})")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def localization_vs_length(rows: list[dict], path: str) -> str:
    """Exact-match accuracy of the needle question against context length, one line per scheme."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    acc = defaultdict(lambda: defaultdict(list))
    for r in rows:
        acc[r["scheme"]][r["length"]].append(r["exact"])
    for scheme, by_len in acc.items():
        lengths = sorted(by_len)
        ax.plot(lengths, [sum(by_len[n]) / len(by_len[n]) for n in lengths], "o-", label=scheme)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("exact answers (fraction)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title("Localization: the penalty rate of Article k")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def key_magnitudes(keys: dict[int, tuple[torch.Tensor, torch.Tensor]], path: str, tokens: int = 512) -> str:
    """|k| per channel (rows) and position (columns) for a few layers, before and after RoPE: pre-RoPE
    channels are steady along the sequence, post-RoPE ones oscillate within each rotated pair."""
    plt = _plt()
    layers = sorted(keys)
    fig, axes = plt.subplots(len(layers), 2, figsize=(10, 2.6 * len(layers)), squeeze=False)
    for row, layer in enumerate(layers):
        pre, post = keys[layer]
        for col, (name, k) in enumerate((("pre-RoPE", pre), ("post-RoPE", post))):
            img = k[:tokens].abs().T.numpy()
            ax = axes[row][col]
            ax.imshow(img, aspect="auto", cmap="magma", interpolation="nearest")
            ax.set_title(f"layer {layer}, KV head 0, {name} |k|", fontsize=9)
            ax.set_ylabel("channel")
            ax.set_xlabel("position")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def ensure_dir(path: str) -> str:
    os.makedirs(path, exist_ok=True)
    return path
