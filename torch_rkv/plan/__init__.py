"""`python -m torch_rkv plan`: the memory ledger. How much context fits on one GPU with each KV scheme.

Byte counts come from torch_rkv.layout.CacheLayout, the code that sizes the real cache's buffers, so a
planned cache is exactly the cache that gets allocated (tests/test_plan.py proves it).

The package, one module a job:
  shape.py     ModelShape, a model as the planner counts it, and MODELS, the presets
  config.py    from_config: a transformers config.json read into a ModelShape
  ledger.py    exact bytes: of a cache, a token, the longest context and the most sequences a budget holds
  budget.py    per-layer allocations that fit a budget (allocation_for_budget, split_for_budget)
  vllm.py      VllmEngine, a vLLM engine with the plugin, and vllm_row, what it holds in a budget
  serve.py     the `vllm serve` command of a planned engine
  request.py   PlanRequest, the command line read and checked
  run.py       run_plan: a request's rows, allocation and serve commands
  report.py    what the command prints of them
  cli.py       the command line: add_arguments and main
Every name below is importable from torch_rkv.plan.
"""

from ..integrations.vllm_pool import VllmPool
from ..layout import CacheLayout
from .budget import allocation_for_budget, split_for_budget
from .cli import DEFAULT_SCHEMES, add_arguments, main
from .config import (
    GPT2_NAMES,
    HYBRID_KEYS,
    PLANNED_LAYER_TYPES,
    from_config,
    layer_types_of,
    sliding_layers_of,
    text_config_of,
)
from .ledger import (
    GB,
    GIB,
    bytes_per_token,
    kv_bytes,
    layer_layouts,
    layouts_bytes,
    ledger_rows,
    longest_context,
    most_sequences,
    paged_sequence_bytes,
    paged_sequences,
)
from .report import OUR_PRESETS, print_allocation, print_contiguous, print_json, print_plan, print_vllm
from .request import DEFAULT_WEIGHT_BITS, PlanRequest, plan_request, weights_of
from .run import PlanResult, run_plan
from .serve import ALLOCATION_PLACEHOLDER, MODEL_PLACEHOLDER, model_path, serve_command, shell_command
from .shape import MODELS, ModelShape
from .vllm import (
    SERVE_BATCHED_TOKENS,
    VLLM_CACHES,
    VllmEngine,
    serve_batched_tokens,
    vllm_bytes,
    vllm_row,
    vllm_rows,
)

__all__ = [
    "ALLOCATION_PLACEHOLDER", "DEFAULT_SCHEMES", "DEFAULT_WEIGHT_BITS", "GB", "GIB", "GPT2_NAMES", "HYBRID_KEYS",
    "MODELS", "MODEL_PLACEHOLDER", "OUR_PRESETS", "PLANNED_LAYER_TYPES", "SERVE_BATCHED_TOKENS", "VLLM_CACHES",
    "CacheLayout", "ModelShape", "PlanRequest", "PlanResult", "VllmEngine", "VllmPool", "add_arguments",
    "allocation_for_budget", "bytes_per_token", "from_config", "kv_bytes", "layer_layouts", "layer_types_of",
    "layouts_bytes", "ledger_rows", "longest_context", "main", "model_path", "most_sequences", "paged_sequence_bytes",
    "paged_sequences", "plan_request", "print_allocation", "print_contiguous", "print_json", "print_plan",
    "print_vllm", "run_plan", "serve_batched_tokens", "serve_command", "shell_command", "sliding_layers_of",
    "split_for_budget", "text_config_of", "vllm_bytes", "vllm_row", "vllm_rows", "weights_of",
]
