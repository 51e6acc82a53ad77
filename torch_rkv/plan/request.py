"""What one `python -m torch_rkv plan` asks, read from its command line and checked: PlanRequest, the model
(with --vllm, one GPU's share of it), the schemes to count, the bytes the cache may take, and the options the
report and a per-layer allocation need. Every refusal here ends the command with its message."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .. import scheme as S
from ..integrations.vllm import PRE_ROPE_MODELS
from ..scheme import Scheme
from ..weights import checkpoint_weight_bytes
from .config import from_config
from .ledger import GB
from .shape import MODELS, ModelShape
from .vllm import VLLM_CACHES, VllmEngine, serve_batched_tokens

DEFAULT_WEIGHT_BITS = 4.0  # the article's example: a 70B-class model in 4-bit weights on one 80 GB GPU


@dataclass(frozen=True)
class PlanRequest:
    """One plan, its options read: what to count (model, schemes, engine), in how many bytes (budget), for
    which requests (context, batch), and what the report and a per-layer allocation read of the options."""

    model: ModelShape  # with an engine, one GPU's share of its KV heads
    schemes: list[tuple[str, Scheme | None]]  # (name, scheme); None: vLLM's own cache, or fp16, of that name
    left_out: list[str]  # the schemes asked for that the plugin would not serve on this model
    unrotated: bool  # with --vllm, a model the plugin rebuilds no rotary tables for (so serves no pre-RoPE scheme)
    engine: VllmEngine | None  # with --vllm, the engine planned
    budget: float  # bytes for the cache (with an engine, one GPU's for its pages and the side pool)
    weight: float  # bytes of the weights (0 with --budget-gb)
    weighed: str  # where `weight` came from
    context: int
    batch: int
    dtype: str  # the model dtype's name
    gpu_gb: float
    reserve_gb: float
    budget_given: bool  # --budget-gb gave the budget itself
    config: str | None
    sensitivity: str | None  # a sensitivity profile's file: plan a per-layer allocation too
    split: bool  # --split: that allocation keeps one key + value total in every layer
    out: str | None  # where to write that allocation
    explicit_batched_tokens: bool  # --max-num-batched-tokens was given (the serve command then passes it)
    json: bool


@contextmanager
def refusals(errors: tuple[type[Exception], ...] = (ValueError,)):
    """End the command with the message of an error of `errors` the planner raises (theirs begin "plan: ")."""
    try:
        yield
    except errors as e:
        raise SystemExit(f"torch_rkv {e}")


def plan_request(args) -> PlanRequest:
    """The request of parsed command-line `args` (plan's add_arguments), or the command's end with a refusal."""
    model = model_of(args)
    weight, weighed = 0.0, "--budget-gb"
    if args.budget_gb is None:
        with refusals():
            weight, weighed = weights_of(model, args)
    schemes, left_out, unrotated = schemes_of(args, model)
    if args.budget_gb is not None:  # the KV budget itself
        gpu, weight, reserve = args.budget_gb * GB, 0.0, 0.0
    else:
        gpu, reserve = args.gpu_gb * GB, args.reserve_gb * GB
    engine = engine_of(args) if args.vllm else None
    budget = gpu - weight / (engine.tensor_parallel if engine else 1) - reserve  # (one GPU's: its share of weights)
    if engine is not None:  # from here on one GPU's share of the KV heads too
        with refusals():
            model = engine.rank(model)
    elif args.tensor_parallel_size != 1:
        raise SystemExit("torch_rkv plan: --tensor-parallel-size plans a vLLM engine; add --vllm")
    return PlanRequest(model, schemes, left_out, unrotated, engine, budget, weight, weighed, args.context, args.batch,
                       args.dtype, args.gpu_gb, args.reserve_gb, args.budget_gb is not None, args.config,
                       args.sensitivity, args.split, args.out, args.max_num_batched_tokens is not None, args.json)


def model_of(args) -> ModelShape:
    """The model of --config, else the preset --model."""
    if args.config:
        with refusals():
            return from_config(args.config, args.params)
    if args.model.lower() in MODELS:
        return MODELS[args.model.lower()]
    raise SystemExit(f"torch_rkv plan: unknown model {args.model!r}; use one of {', '.join(MODELS)} or --config")


def weights_of(model: ModelShape, args) -> tuple[float, str]:
    """(bytes, how) of the weights on the GPU: --weight-gb, --weight-bits, the checkpoint beside --config
    (the bytes an engine loads in --dtype, whatever its quantization), or DEFAULT_WEIGHT_BITS."""
    if args.weight_gb is not None:
        return args.weight_gb * GB, "--weight-gb"
    if args.weight_bits is not None:
        return model.weight_bytes(args.weight_bits), f"{args.weight_bits:g}-bit"
    found = checkpoint_weight_bytes(args.config, getattr(torch, args.dtype)) if args.config else None
    if found is not None:
        return float(found[0]), f"the checkpoint's {found[1]}"
    return model.weight_bytes(DEFAULT_WEIGHT_BITS), f"{DEFAULT_WEIGHT_BITS:g}-bit; --weight-bits sets it"


def schemes_of(args, model: ModelShape) -> tuple[list[tuple[str, Scheme | None]], list[str], bool]:
    """(the schemes to count, the names of those left out, whether the model is unrotated: PlanRequest): the
    full-precision rows (with --vllm, vLLM's own caches) and --schemes; with --vllm, the pre-RoPE schemes the
    plugin would not serve on the model are left out, and said so on stderr."""
    schemes: list[tuple[str, Scheme | None]] = [(name, None) for name in VLLM_CACHES] if args.vllm else [("fp16", None)]
    for spec in args.schemes:
        base, plus, count = spec.rpartition("+")
        if not (plus and count.isdigit()):
            schemes.append((spec, S.by_name(spec)))
            continue
        if not getattr(args, "channels", None):
            raise ValueError(f"--schemes {spec}: refined key channels need the model's ranking: --channels FILE "
                             "(torch_rkv.eval.channels)")
        if getattr(args, "tensor_parallel_size", 1) > 1:
            raise ValueError(f"--schemes {spec}: the vLLM plugin refuses refined key channels with tensor "
                             "parallelism (a rank keeps a share of the KV heads the ranking ranks)")
        schemes.append((spec, S.refined(S.by_name(base), int(count), args.channels)))
    # (the plugin rebuilds rotary tables for PRE_ROPE_MODELS alone, and refuses pre-RoPE schemes for others)
    unrotated = bool(args.vllm and model.family and model.family not in PRE_ROPE_MODELS)
    left_out = [name for name, scheme in schemes if unrotated and scheme is not None and scheme.pre_rope]
    schemes = [(name, scheme) for name, scheme in schemes if name not in left_out]
    if left_out:
        why = (f"left out: {', '.join(left_out)} (pre-RoPE schemes, which the plugin serves for "
               f"{', '.join(PRE_ROPE_MODELS)}, not {model.family!r}; post-RoPE ones serve any decoder)")
        print(why, file=sys.stderr)
    return schemes, left_out, unrotated


def engine_of(args) -> VllmEngine:
    """The vLLM engine --vllm plans, as its options run it (max_num_batched_tokens: vllm serve's default on the
    device unless given)."""
    return VllmEngine(getattr(torch, args.dtype), args.device, args.block_size, args.max_num_seqs,
                      args.max_num_batched_tokens or serve_batched_tokens(args.device, args.gpu_gb * GB,
                                                                          args.tensor_parallel_size),
                      not args.disable_hybrid_kv_cache_manager, args.tensor_parallel_size,
                      args.num_speculative_tokens, args.prefix_caching, args.mamba_ssm_cache_dtype)
