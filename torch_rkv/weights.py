"""What a model's weights take: their count, from a transformers config (every expert, a hybrid's mixers, a
vision tower), and their bytes, from the checkpoint beside it as an engine loads it. The planner subtracts them
from the GPU (`python -m torch_rkv plan --config`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


def special_floats(obj: dict):
    """transformers' config.json spells infinities and NaN as {"__float__": "Infinity"} (Granite 4's
    time_step_limit): its config classes take them as floats (a json.load object_hook)."""
    if set(obj) == {"__float__"} and obj["__float__"] in ("Infinity", "-Infinity", "NaN"):
        return float(obj["__float__"])
    return obj


def built_config(cfg: dict):
    """The transformers config of a config.json's dict, its defaults filled in; raises where transformers is
    missing or does not know or cannot build it."""
    from transformers import AutoConfig

    return AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def params_of(cfg: dict) -> int:
    """Every weight of the transformers model a config.json describes (experts, a hybrid's mixers, a vision
    tower, an untied head), counted on an instance built on the meta device: no memory, no download. Raises
    where transformers is missing or cannot build it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    built = built_config(cfg)
    error = None
    for auto in (AutoModelForImageTextToText, AutoModelForCausalLM):  # (a VL model's whole, then a decoder's)
        try:
            with torch.device("meta"):
                model = auto.from_config(built)
        except ValueError as e:  # (this mapping does not know the config's class)
            error = e
            continue
        return sum(p.numel() for p in model.parameters())  # (tied weights once)
    raise error


# config keys of a mixture of experts (their value: experts a layer), whose weights a dense estimate misses
EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def estimate_params(path: str, cfg: dict, whole: dict, shape: tuple[int, int], recurrent: int,
                    error: Exception) -> int:
    """A dense decoder's weights from its config (embeddings + attention of `shape`, KV heads x head_dim, + a
    gated MLP), where transformers cannot count them (params_of failed: `error`); refuses, by name, a model
    whose other weights it would miss."""
    experts = {k: cfg[k] for k in EXPERT_KEYS if (cfg.get(k) or 0) > 1}
    missed = ([f"experts ({experts})"] if experts else []) + ([f"{recurrent} recurrent layers"] if recurrent else [])
    missed += [f"a {k}" for k in ("vision_config", "audio_config") if k in whole]
    if missed:
        raise ValueError(f"plan: {path} has {', '.join(missed)}, whose weights only transformers can count, and that "
                         f"failed ({type(error).__name__}: {error}); give --params")
    hidden = cfg["hidden_size"]
    attn = hidden * shape[1] * (cfg["num_attention_heads"] * 2 + shape[0] * 2)
    mlp = 3 * hidden * (cfg.get("intermediate_size") or 4 * hidden)
    emb = cfg.get("vocab_size", 0) * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return cfg["num_hidden_layers"] * (attn + mlp) + emb


# a checkpoint's weights: its safetensors shards, else the index naming them, else PyTorch's files (never a
# Trainer's optimizer.bin or training_args.bin, nor PyTorch's files beside safetensors ones)
SAFETENSORS, SAFETENSORS_INDEX = "model*.safetensors", "model.safetensors.index.json"
TORCH_FILES, TORCH_INDEX = "pytorch_model*.bin", "pytorch_model.bin.index.json"
# safetensors' floating dtypes of 16 bits or more, which an engine casts to the model dtype (--dtype) as it
# loads them; 8-bit floats and integers (fp8, packed AWQ/GPTQ/MXFP4 codes) it keeps as saved
CAST_FLOATS = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}
CONFIG_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
GB_BYTES = 1000**3


def mtp_tensor(name: str, layers: int | None) -> bool:
    """Whether a checkpoint tensor belongs to a multi-token-prediction module, which vLLM loads only for MTP
    speculative decoding (its models' load_weights skip them): a name part starting with "mtp" (Qwen3-Next's
    and Qwen3.5's mtp., MiMo's model.mtp_layers, ERNIE 4.5's mtp_*), or a decoder layer past the config's
    `layers` (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers, MiniMax-M2's num_mtp_modules)."""
    parts = name.split(".")
    if any(part.startswith("mtp") for part in parts):
        return True
    if layers is None or any(tower in part for part in parts for tower in TOWERS):
        return False
    return any(part == "layers" and index.isdigit() and int(index) >= layers and (i == 0 or parts[i - 1] in DECODERS)
               for i, (part, index) in enumerate(zip(parts, parts[1:])))


DECODERS = ("model", "language_model", "backbone")  # (what holds a decoder's layers)
TOWERS = ("vision", "visual", "audio")  # (a tower's layers, numbered on their own: Llama 4's vision_model.model)


def safetensors_bytes(path: Path, dtype: torch.dtype, layers: int | None = None) -> tuple[int, int]:
    """(the bytes a safetensors file's tensors take loaded in `dtype`, those of its MTP tensors, which are not
    among them: mtp_tensor). From its header (each tensor's dtype and offsets): 8-bit and integer tensors as
    saved, wider floats cast to `dtype`."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= path.stat().st_size - 8:  # (a Git LFS pointer, a truncated download)
                raise ValueError(f"a header of {length} bytes in a file of {path.stat().st_size}")
            header = json.loads(f.read(length))
        sizes = [(name, t["dtype"], t["data_offsets"][1] - t["data_offsets"][0]) for name, t in header.items()
                 if name != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise ValueError(f"plan: {path} has no readable safetensors header ({type(e).__name__}: {e}); give "
                         "--weight-gb or --weight-bits") from e
    held, mtp = 0, 0
    for name, kind, size in sizes:
        loaded = size // CAST_FLOATS[kind] * dtype.itemsize if kind in CAST_FLOATS else size
        if mtp_tensor(name, layers):
            mtp += loaded
        else:
            held += loaded
    return held, mtp


def checkpoint_folder(config_path: str) -> Path:
    """The folder of a config.json, as given (a Hugging Face snapshot's config.json links into blobs/, which
    holds no names)."""
    return Path(config_path).absolute().parent


def holds_weights(config_path: str) -> bool:
    """Whether the folder of a config.json holds a checkpoint's weights (or their index)."""
    folder = checkpoint_folder(config_path)
    return any(next(folder.glob(pattern), None) for pattern in (SAFETENSORS, SAFETENSORS_INDEX, TORCH_FILES,
                                                                 TORCH_INDEX))


def _names(files: list[Path]) -> str:
    return ", ".join(f.name for f in files[:2]) + (", ..." if len(files) > 2 else "")


def _index(path: Path, layers: int | None = None) -> dict:
    try:
        index = json.loads(path.read_text())
        return {"total": int(index.get("metadata", {}).get("total_size") or 0),
                "shards": set(index.get("weight_map", {}).values()),
                "mtp": any(mtp_tensor(name, layers) for name in index.get("weight_map", {}))}
    except (OSError, ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"plan: {path} is not a checkpoint index ({type(e).__name__}: {e}); give --weight-gb "
                         "or --weight-bits") from e


def checkpoint_weight_bytes(config_path: str, dtype: torch.dtype = torch.bfloat16) -> tuple[int, str] | None:
    """(bytes, where from) of the weights in the checkpoint beside a config.json, as an engine running the model
    in `dtype` holds them: 8-bit and integer tensors (fp8, AWQ, MXFP4) as saved, floats cast to `dtype` (a
    float32 save, or a bf16 one served in float32). From the safetensors shards' headers, when every shard its
    index names is there; else from the index's total_size or PyTorch's files' sizes, scaled from the config's
    dtype where it has no quantization; None where the folder holds no weights. Multi-token-prediction layers
    (mtp_tensor) are left out where the headers are read, and named where the index's total includes them."""
    folder = checkpoint_folder(config_path)
    with open(config_path) as f:
        cfg = json.load(f, object_hook=special_floats)
    text = cfg.get("text_config") or cfg
    layers = text.get("num_hidden_layers") or text.get("n_layer")
    shards = sorted(folder.glob(SAFETENSORS))
    named = _index(folder / SAFETENSORS_INDEX, layers) if (folder / SAFETENSORS_INDEX).exists() else None
    missing = sorted(named["shards"] - {f.name for f in shards}) if named else []
    if shards and not missing:
        held = [safetensors_bytes(f, dtype, layers) for f in shards]
        mtp = sum(m for _, m in held)
        return sum(h for h, _ in held), _names(shards) + (
            f" less {mtp / GB_BYTES:.1f} GB of MTP layers, which vLLM loads only for MTP speculative decoding"
            if mtp else "")
    torch_index = _index(folder / TORCH_INDEX) if (folder / TORCH_INDEX).exists() else None
    total, where = 0, None
    if named and named["total"]:
        total, where = named["total"], SAFETENSORS_INDEX + (f" ({len(missing)} shards not here)" if missing else "")
        where += ", MTP layers included (vLLM loads them only for MTP speculative decoding)" if named["mtp"] else ""
    elif torch_index and torch_index["total"]:
        total, where = torch_index["total"], TORCH_INDEX
    elif found := sorted(folder.glob(TORCH_FILES)):
        total, where = sum(f.stat().st_size for f in found), _names(found)
    if not total:
        if missing:
            raise ValueError(f"plan: {folder / SAFETENSORS_INDEX} names shards that are not there ({missing[:3]}) "
                             "and gives no total_size; give --weight-gb or --weight-bits")
        return None
    saved = CONFIG_DTYPES.get(cfg.get("dtype") or cfg.get("torch_dtype") or text.get("dtype"))
    if saved and saved != dtype.itemsize and "quantization_config" not in cfg:
        total = total // saved * dtype.itemsize
        where += f", {saved * 8}-bit floats held in {str(dtype).removeprefix('torch.')}"
    return int(total), where
