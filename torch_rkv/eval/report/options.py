"""The report's options: which rows it measures, on how many tokens, and the --quick and --full sets."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .. import sensitivity
from .families import CALIBRATED_LEVELS, DEFAULT_FAMILIES, FULL_FAMILIES
from .names import RowName

# issue 50's goals at 8192 tokens of alice29, (most bits at the window, most delta, least top-8 recall), and
# the row put forward for each (scripts/long_context.py --goals; --full measures them too)
GOALS = (((2.6, 0.40, 0.92), "rkv-lean-alloc-2.1"), ((3.2, 0.10, 0.0), "rkv-lean-alloc-2.5+12"),
         ((4.2, 0.03, 0.0), "rkv-lean-alloc-3.6+8"))
GOAL_ROWS = tuple(name for _, name in GOALS)
# the KL baseline the goals' KL is judged against (docs/guide.md, measured at 48f48ea): (bits at the window, mean
# KL) of rkv-2, rkv-sparse-alloc-2.2, rkv-alloc-2.5, rkv-3 and rkv-4; a goal row's KL must be at most half of
# that of the row with the fewest bits at no fewer than its own
KL_BASELINE = ((2.59, 0.0762), (2.95, 0.0202), (3.09, 0.0116), (3.58, 0.0220), (4.56, 0.0036))


def kl_bound(bits: float) -> float:
    """Half the KL of the baseline row nearest above `bits` (inf above every row)."""
    above = [kl for b, kl in KL_BASELINE if b >= bits]
    return above[0] / 2 if above else float("inf")


@dataclass
class Options:
    """What the report measures. Scheme names are the strings RowName.parse reads; timings collects each
    section's seconds as the report runs."""

    tokens: int = 2048
    bits: tuple = (4, 3, 2)
    families: tuple = DEFAULT_FAMILIES
    noise: bool = False  # rows off their reference are rerun with eager attention: how much the kernel moves them
    loc_lengths: tuple = (1024, 2048)  # (--full: to 8192; 6 needles a length are a smoke test, 24 measure)
    loc_schemes: tuple = ("per-token-3", "rkv-3", "rkv-2")
    loc_documents: int = 1  # per length, 6 needles each (--full: 4, 24 needles a length)
    long_tokens: int = 0  # > 0 (--full): a long-context perplexity row at this many tokens
    long_schemes: tuple = ("rkv-4", "rkv-3", "rkv-2", "turboquant-4")
    decode_tokens: int = 384  # long enough that every decode scheme quantizes a block
    decode_schemes: tuple = ("rkv-4", "kivi-2")  # pre-RoPE and post-RoPE keys (--full: more)
    chunk_sizes: tuple = (256,)  # chunked prefill over the whole text, served through RKVCache (--full: 1024 too)
    chunk_schemes: tuple = ("rkv-4", "rkv-3", "rkv-2")
    alloc_levels: tuple = (2, 3, 4)  # per-layer allocation: widths to choose among, and average code bits
    alloc_targets: tuple = (2.5, 3.0)
    split_targets: tuple = (3.0,)  # allocate_split: average code bits (multiples of 0.5)
    alloc_tokens: int = sensitivity.CALIBRATION_TOKENS  # of the calibration text
    second_text: str = ""  # --full: asyoulik.txt, the same schemes ranked on a text the calibration never saw
    # windows of `tokens` tokens per text the second-text check scores (the first text's first is the
    # schemes table's). One window leaves a small loss about as uncertain as the loss itself (docs/measurements.md)
    # (--full: 8, 16384 tokens a text)
    second_windows: int = 1
    second_schemes: tuple = ("rkv-4", "rkv-3", "rkv-mixed-2", "rkv-2")
    # at 8 bits: vLLM's own fp8 cache (its default, scale 1) beside rkv-8, measured like the schemes
    eight_bits: tuple = ("vllm-fp8", "rkv-8")
    peers: bool = False
    out_dir: str = "out/report"
    timings: dict = field(default_factory=dict)

    @classmethod
    def full(cls) -> Options:
        """The heavy rows too: perplexity at 8192 tokens (SmolLM2's window, where the full-precision
        tokens cost little), localization at 8192 with 24 needles a length, the eager reruns, the grouped
        family, more localization and decode schemes, the peers and the second text."""
        return cls(long_tokens=8192, loc_lengths=(1024, 2048, 4096, 8192), loc_documents=4, noise=True,
                   families=FULL_FAMILIES,
                   # one scheme near each of three bit widths (docs/measurements.md, "Localization")
                   loc_schemes=("rkv-4", "rkv-sparse-alloc-2.5", "rkv-2"),
                   decode_schemes=("rkv-4", "rkv-3", "rkv-2", "kivi-2", "rkv-alloc-2.5", "rkv-sparse-2",
                                   "rkv-sparse-alloc-2.5", *GOAL_ROWS),
                   # rkv-sparse-alloc-2.2: the row near 2 bits (docs/measurements.md, "The 2.4-bit goal")
                   long_schemes=("rkv-4", "rkv-3", "rkv-2", "rkv-alloc-2.5", "rkv-sparse-alloc-2.5", "rkv-sparse-3",
                                 "rkv-sparse-2", "rkv-sparse-alloc-2.2", "turboquant-4", *GOAL_ROWS),
                   alloc_targets=(2.5, 3.0, 3.5), split_targets=(3.0, 3.5), chunk_sizes=(256, 1024),
                   second_text="asyoulik.txt", second_windows=8, peers=True,
                   second_schemes=("rkv-4", "rkv-3", "rkv-mixed-2", "rkv-2", *GOAL_ROWS))

    def named_schemes(self) -> tuple:
        """Every scheme a row names beside the families' (localization, long context, decode, chunks, second text)."""
        return self.loc_schemes + self.long_schemes + self.decode_schemes + self.chunk_schemes + self.second_schemes

    def uses_profile(self) -> bool:
        """Whether a row needs the model's per-layer sensitivity profile (an allocation, a split)."""
        return bool(self.alloc_targets or self.split_targets
                    or any(RowName.parse(name).profiled for name in self.named_schemes()))

    def per_layer(self) -> bool:
        """Whether a row measures or fits every layer's own cache: the profile's rows and the calibrated levels."""
        return self.uses_profile() or CALIBRATED_LEVELS in self.families or \
            any(RowName.parse(name).per_layer for name in self.named_schemes())

    def without_per_layer(self) -> Options:
        """These options less the per_layer rows (for a model whose layers do not all keep a KV cache)."""
        def uniform(names):
            return tuple(n for n in names if not RowName.parse(n).per_layer)

        return replace(self, alloc_targets=(), split_targets=(),
                       families=tuple(f for f in self.families if f != CALIBRATED_LEVELS),
                       **{k: uniform(getattr(self, k)) for k in ("loc_schemes", "long_schemes", "decode_schemes",
                                                                  "chunk_schemes", "second_schemes")})

    def without_chunks(self) -> Options:
        """These options less the rows that put several tokens over a filled cache (localization, chunks)."""
        return replace(self, loc_lengths=(), chunk_sizes=())

    def unrunnable(self, attention) -> list:
        """(refusal, the options without those rows) for each group of rows the model of `attention` (its
        models.ModelAttention) cannot run: the per-layer rows of a model some of whose layers keep no KV cache
        of their own; the rows that put several tokens over a recurrent state its mixer would drop (Jamba's)."""
        from ...integrations import models

        def per_layer():
            models.refuse_cacheless_layers(attention, "the report's per-layer rows (alloc_targets, split_targets, "
                                                      "calibrated levels)")

        def chunks():  # (each question, each chunk: several tokens over the cache)
            models.refuse_chunks_over_state(attention.model_type, "the report's localization and chunked prefill "
                                                                  "rows (loc_lengths, chunk_sizes)")

        checks = ((self.per_layer(), Options.without_per_layer, per_layer),
                  (self.loc_lengths or self.chunk_sizes, Options.without_chunks, chunks))
        out = []
        for wanted, without, refuse in checks:
            try:
                if wanted:
                    refuse()
            except models.UnsupportedModelFeature as e:
                out.append((e, without))
        return out

    @classmethod
    def quick(cls) -> Options:
        """A short run: 1024 tokens, 4 and 2 bits, five families, one length of localization."""
        return cls(tokens=1024, bits=(4, 2), families=("per-token (baseline)", "KIVI (per-channel post-RoPE)",
                                                      "QuaRot-style (Hadamard)", "rkv (recommended)",
                                                      "TurboQuant-style (Hadamard + Lloyd-Max + norm)"),
                   noise=False, loc_lengths=(1024,), loc_schemes=("per-token-2", "rkv-2"), loc_documents=1,
                   decode_tokens=96,
                   decode_schemes=("per-token-4",), chunk_sizes=(256,), chunk_schemes=("rkv-2",), peers=False)
