"""Localization: the article's failure mode that perplexity hides.

A long document (haystack text with numbered articles inserted at several depths, each with a distinct
penalty rate) is followed by a question about one article: "What is the penalty rate under Article 37?".
The metrics are the log-probability of the right rate and whether greedy decoding reproduces it
exactly, for several needle depths and context lengths, with full precision as the reference. Each
document is run once; every question reuses its cache (rolled back after each: rewind). Several
documents per length (different haystack slices, articles and depths) give enough needles for the exact
rate's binomial interval (wilson) to say something: 6 needles a length cannot tell 2 of 6 from 5 of 6.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

from ..integrations.models import RECURRENT_LAYER_TYPES, text_config
from .data import bos_text
from .simulate import Simulation, install

QUESTION = "\n\nQuestion: What is the penalty rate under Article {k}?\nAnswer: The penalty rate under Article {k} is"
ANSWER = " {r} percent"
ARTICLE = "\n\nArticle {k}. The penalty rate under Article {k} is {r} percent.\n\n"


@dataclass
class Needle:
    article: int
    rate: int
    depth: float  # fraction of the document before it


@dataclass
class Document:
    length: int
    ids: torch.Tensor  # (1, n) from the document start (data.bos_text)
    needles: list[Needle]


def build_document(tok, haystack: str, length: int, needles: int = 6, seed: int = 0) -> Document:
    """About `length` tokens: a haystack slice with `needles` articles at random depths."""
    rng = random.Random(seed * 7919 + length)
    articles = rng.sample(range(10, 99), needles)
    rates = rng.sample(range(11, 99), needles)
    hay = tok(haystack, return_tensors="pt").input_ids[0]
    budget = length - 40 - 28 * needles  # room for the articles and the question
    if budget <= needles + 1 or len(hay) < budget:
        raise ValueError(f"localization: the haystack text is too short for a {length}-token document")
    start = rng.randint(0, len(hay) - budget)
    hay = hay[start : start + budget]
    cuts = sorted(rng.sample(range(1, budget), needles))
    parts, prev, placed = [bos_text(tok)], 0, []
    for cut, k, r in zip(cuts, articles, rates):
        parts.append(tok.decode(hay[prev:cut]))
        parts.append(ARTICLE.format(k=k, r=r))
        placed.append(Needle(k, r, cut / budget))
        prev = cut
    parts.append(tok.decode(hay[prev:]))
    ids = tok("".join(parts), return_tensors="pt").input_ids
    return Document(length, ids, placed)


def build_documents(tok, haystack: str, length: int, count: int, needles: int = 6) -> list[Document]:
    """`count` documents of about `length` tokens, each with its own slice, articles and depths."""
    return [build_document(tok, haystack, length, needles, seed) for seed in range(count)]


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of a binomial rate k / n (sound at 0 and n, unlike the normal one)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_gap(rows: list[dict], reference: list[dict], z: float = 1.96) -> tuple[float, float, float]:
    """The mean change of log p(right rate) from `reference` over the same needles (rows in the same order,
    as evaluate returns them for the same documents), with its 95% normal interval (z standard errors of
    the paired differences): (mean, low, high), nats."""
    if len(rows) != len(reference) or any(a["article"] != b["article"] for a, b in zip(rows, reference)):
        raise ValueError("paired_gap: the rows and the reference must hold the same needles in the same order")
    d = [a["logprob"] - b["logprob"] for a, b in zip(rows, reference)]
    if not d:
        return 0.0, 0.0, 0.0
    mean = sum(d) / len(d)
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (len(d) - 1)) if len(d) > 1 else math.inf
    half = z * sd / math.sqrt(len(d))
    return mean, mean - half, mean + half


@torch.no_grad()
def evaluate(model, tok, doc: Document, simulation: Simulation | None) -> list[dict]:
    """Per needle: log p(right rate), exact greedy match, and the greedy answer."""
    install(model, simulation)
    cache = document_cache(model)
    model(doc.ids, cache=cache, use_cache=True)
    n = doc.ids.shape[1]
    states = recurrent_states(cache)
    out = []
    for needle in doc.needles:
        q = tok(QUESTION.format(k=needle.article), return_tensors="pt", add_special_tokens=False).input_ids
        a = tok(ANSWER.format(r=needle.rate), return_tensors="pt", add_special_tokens=False).input_ids
        seq = torch.cat([q, a], dim=1)
        logits = model(seq, cache=cache, use_cache=True).logits[0, q.shape[1] - 1 : -1].float()
        rewind(cache, n, states)
        target = a[0]
        logp = F.log_softmax(logits, dim=-1).gather(1, target[:, None]).sum().item()
        greedy = logits.argmax(-1)
        out.append({"length": doc.length, "depth": needle.depth, "article": needle.article, "logprob": logp,
                    "exact": bool(torch.equal(greedy, target)), "answer": tok.decode(greedy)})
    return out


def document_cache(model) -> DynamicCache:
    """A cache whose attention layers keep every key (a sliding layer's too: a key's index is then its position
    for the simulation; the model's mask still limits what a window layer sees), and whose recurrent layers (a
    hybrid's) keep their states in transformers' own layer classes, which its config names. (A layer type that
    pairs a sliding window with a recurrent state, "hybrid_sliding", stays transformers' ring: models.inspect
    refuses it.)"""
    types = getattr(text_config(model), "layer_types", None) or ()
    if not set(types) & set(RECURRENT_LAYER_TYPES):
        return DynamicCache()  # (no config: every layer a DynamicLayer, appended as the model updates it)
    cache = DynamicCache(config=model.config)
    cache.layers = [DynamicLayer() if type(layer) is DynamicSlidingWindowLayer else layer for layer in cache.layers]
    return cache


def recurrent_states(cache: DynamicCache) -> list[tuple]:
    """A copy of every recurrent layer's state (and its token count), which rewind puts back."""
    return [(layer, {i: t.clone() for i, t in layer.conv_states.items() if t is not None},
             {i: t.clone() for i, t in layer.recurrent_states.items() if t is not None},
             layer.cumulative_length_linear.clone())
            for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def rewind(cache: DynamicCache, tokens: int, states: list[tuple]) -> None:
    """Back to the document's first `tokens` tokens after a question: the attention layers drop the question's
    keys and values; the recurrent layers, whose states cannot be cropped, take back those saved after the
    document (recurrent_states). Falcon-H1's layers hold both."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer) and layer.is_initialized:  # (a KV-shared layer keeps none)
            DynamicLayer.crop(layer, tokens - DynamicLayer.get_seq_length(layer))
    for layer, conv, recurrent, count in states:
        for i, t in conv.items():
            layer.conv_states[i].copy_(t)
        for i, t in recurrent.items():
            layer.recurrent_states[i].copy_(t)
        layer.cumulative_length_linear.copy_(count)
