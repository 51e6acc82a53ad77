"""`python -m torch_rkv report`: measured quality of every KV-cache scheme on a real model and real text.

1. reproduction of the reference fake-quant measurements (every position quantized, fp32 metadata);
2. the schemes as served (cache view, fp16 metadata): perplexity, its change, effective bits, and
   attention fidelity (output cosine, top-8 recall) against full precision; and at 8 bits vLLM's own
   fp8 cache beside rkv-8;
3. localization: the penalty rate of Article k in long documents, several depths and lengths;
4. the decode protocol: token by token through the real cache and fused kernel, against the
   simulation on the same window (the proof that the served path is the measured one);
5. per-layer bit allocation: a sensitivity profile measured on a calibration text (lcet10.txt, cached),
   the allocation the knapsack picks at each target, measured here like the schemes;
6. --full: peers when installed (transformers' QuantizedCache, quanto and HQQ, token by token on that
   window), perplexity at 8192 tokens, 24 needles a length, and the ranking on a second text
   (asyoulik.txt, 8 windows of 2048 tokens on each text);
7. plots (PNG) and every number in --json. Progress and an ETA on the terminal as it runs.

Each part is a Section (section.py) that knows whether the options ask for it, what it costs and how
to run it; plan.py lists them in order, and the progress ETA is the cost of the sections that run.
Rows are named by RowName (names.py). This package's names below are the ones callers import.
"""

from .bits import bits_parts_at, effective_bits_at
from .cli import main
from .families import CALIBRATED_LEVELS, DEFAULT_FAMILIES, FAMILIES, FULL_FAMILIES
from .names import ALLOCATED, FULL, NON_UNIFORM, SPARSE_ALLOCATED, SPLIT, RowName, TextRow
from .options import GOALS, Options, kl_bound
from .plan import SECTIONS, Plan
from .report import Report
from .reproduction import REFERENCE, TOLERANCE, reference_scheme
from .section import Section
from .tables import format_localization, format_long_context, format_second_text, format_tables

__all__ = ["ALLOCATED", "CALIBRATED_LEVELS", "DEFAULT_FAMILIES", "FAMILIES", "FULL", "FULL_FAMILIES", "GOALS",
           "NON_UNIFORM", "REFERENCE", "SECTIONS", "SPARSE_ALLOCATED", "SPLIT", "TOLERANCE", "Options", "Plan",
           "Report", "RowName", "Section", "TextRow", "bits_parts_at", "effective_bits_at", "format_localization",
           "format_long_context", "format_second_text", "format_tables", "kl_bound", "main", "reference_scheme"]
