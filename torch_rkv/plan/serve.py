"""How to serve a planned vLLM engine: serve_command, the environment and `vllm serve` arguments under which
vLLM logs the planned tokens and concurrency, and shell_command, the one line to run it."""

from __future__ import annotations

import json
import shlex

from ..integrations.vllm import ALLOCATION_ENV, CHANNELS_ENV, CODEBOOK_ENV, ENV, KV_TRANSFER_CONFIG
from ..weights import checkpoint_folder, holds_weights
from .shape import ModelShape
from .vllm import VLLM_CACHES, VllmEngine

MODEL_PLACEHOLDER = "MODEL"  # vllm serve's model (a Hugging Face id or directory) where plan has no --config
ALLOCATION_PLACEHOLDER = "ALLOCATION.json"  # TORCH_RKV_ALLOCATION where plan writes no --out file


def serve_command(model: ModelShape, engine: VllmEngine, row: dict, context: int, dtype: str,
                  explicit_batched_tokens: bool = False, allocation: str | None = None) -> dict:
    """How to run `vllm serve MODEL` for the engine a vllm_row plans: {"env": variables to set (the
    plugin's scheme or allocation file), "unset": variables to remove (the plugin's others, which the
    shell may hold from another run), "args": the arguments (every engine option the plan's count
    depends on, and the plugin's KV connector)}, so that vLLM logs the planned tokens and concurrency. On CPU VLLM_CPU_KVCACHE_SPACE,
    when set, would override --kv-cache-memory-bytes (vllm/platforms/cpu.py), and vLLM fails on it
    empty, so it is unset too."""
    env = {}
    if allocation is not None:
        env[ALLOCATION_ENV] = allocation
    elif row["scheme"] not in VLLM_CACHES:
        env[ENV] = row["scheme"]
    if row.get("channels"):  # a <preset>+<m> row: the preset, and its refined key channels
        base, _, count = row["scheme"].rpartition("+")
        env[ENV] = base
        env[CHANNELS_ENV] = f"{count}:{row['channels']}"
    unset = [name for name in (ENV, ALLOCATION_ENV, CODEBOOK_ENV, CHANNELS_ENV) if name not in env]
    if engine.device == "cpu":
        unset.append("VLLM_CPU_KVCACHE_SPACE")
    args = ["--dtype", dtype, "--max-model-len", str(context), "--max-num-seqs", str(engine.max_num_seqs),
            "--block-size", str(row["block_size"]), "--kv-cache-memory-bytes", str(row["kv_cache_memory_bytes"])]
    if row["scheme"] in VLLM_CACHES and row["scheme"] != "auto":
        args += ["--kv-cache-dtype", row["scheme"]]
    if engine.tensor_parallel > 1:
        args += ["--tensor-parallel-size", str(engine.tensor_parallel)]
    if model.sliding_layers or explicit_batched_tokens:  # (what a sliding layer holds beyond its window)
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if not engine.hybrid:
        args.append("--disable-hybrid-kv-cache-manager")
    if engine.speculative_tokens:
        args += ["--speculative-config", json.dumps({"method": "ngram",
                                                     "num_speculative_tokens": engine.speculative_tokens})]
    if not engine.prefix_caching:
        args.append("--no-enable-prefix-caching")
    if engine.ssm_dtype != "auto":
        args += ["--mamba-ssm-cache-dtype", engine.ssm_dtype]
    if env:  # (the plugin's KV connector names each step's requests to its backend)
        args += ["--kv-transfer-config", json.dumps(KV_TRANSFER_CONFIG, separators=(",", ":"))]
    return {"env": env, "unset": unset, "args": args}


def shell_command(serve: dict, model_path: str) -> str:
    """The one-line shell command of a serve_command."""
    prefix = ["env", *(f"-u {name}" for name in serve["unset"])] if serve["unset"] else []
    return " ".join([*prefix, *(f"{k}={shlex.quote(v)}" for k, v in serve["env"].items()), "vllm", "serve",
                     shlex.quote(model_path), *map(shlex.quote, serve["args"])])



def model_path(config: str | None) -> str:
    """What `vllm serve` loads: the directory of --config when it holds the weights too, or
    MODEL_PLACEHOLDER (a config.json on its own)."""
    if config and holds_weights(config):
        return str(checkpoint_folder(config))
    return MODEL_PLACEHOLDER
