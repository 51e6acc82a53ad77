"""The report's tables as printed: the schemes, the allocations, the second text, long context,
localization, the decode protocol, chunked prefill and the peers."""

from __future__ import annotations

from .. import localization
from .names import FULL


def format_second_text(second: list[dict]) -> str:
    """The second text's tables, relative perplexity change and then mean KL from full precision: each
    on both texts with its 95% interval, their ratio, and the second-text check's two criteria (same
    ranking; every value within 1.5x of the other text's), judged on the measured values and, for the 1.5x, also on
    whether the ratio's interval overlaps [1/1.5, 1.5] (consistent with the bar) or lies inside it."""
    rows = [x for x in second if x["scheme"] != FULL]
    lines = [(f"\nA second text ({rows[0]['text']}, full precision {second[0]['ppl']:.3f}; {second[0]['tokens']} "
              "tokens a text): relative perplexity change [95% block-bootstrap interval, runs of 128 tokens] beside "
              "the first text's, and their ratio (first / second)")]
    lines += second_text_table(rows, "relative", lambda v: f"{v:+.2%}")
    if any("kl" in x for x in rows):
        lines.append("\nThe same rows' mean KL divergence from full precision's next-token distribution (nats per "
                     "token; it does not depend on which token came next, so it varies less between texts)")
        lines += second_text_table([x for x in rows if "kl" in x], "kl", lambda v: f"{v:.4f}")
    return "\n".join(lines)


def second_text_table(rows: list[dict], measure: str, fmt) -> list[str]:
    """format_second_text's table of one measure, whose row keys (TokenLosses.intervals) are <measure>
    and first_<measure> (the value on each text), <measure>_interval, first_<measure>_interval and
    <measure>_ratio_interval; fmt prints one value."""
    value, first_value = measure, f"first_{measure}"
    iv, first_iv, ratio_iv = f"{measure}_interval", f"first_{measure}_interval", f"{measure}_ratio_interval"

    def span(bounds):
        return f"[{fmt(bounds[0])},{fmt(bounds[1])}]" if bounds else ""

    lines = [f"{'scheme':20s} {'second text':>28s} {'first text':>28s}  ratio"]
    for x in rows:
        first = x[first_value]
        cells = f"{x['scheme']:20s} {fmt(x[value]):>8s} {span(x.get(iv)):>19s}"
        if first is not None:
            ratio = x.get(ratio_iv)
            cells += (f" {fmt(first):>8s} {span(x.get(first_iv)):>19s}  "
                      + (f"{first / x[value]:.2f}" if x[value] > 0 else "-")
                      + (f" [{ratio[0]:.2f},{ratio[1]:.2f}]" if ratio else
                         " [second text's interval reaches 0]" if iv in x else ""))
        lines.append(cells)
    known = [x for x in rows if x[first_value] is not None]
    same = [x["scheme"] for x in sorted(known, key=lambda x: x[value])] == \
        [x["scheme"] for x in sorted(known, key=lambda x: x[first_value])]
    # a row lost nothing on both texts (every token in full precision) says nothing either way; a loss on
    # one text and a gain or nothing on the other is as far from 1.5x as can be
    within = all(0 < min(a, b) and max(a, b) <= 1.5 * min(a, b)
                 for a, b in ((x[value], x[first_value]) for x in known) if a != 0 or b != 0)
    verdict = (f"same ranking: {'yes' if same else 'NO'}; every value within 1.5x of the first text's: "
               f"{'yes' if within else 'NO'}")
    bounded = [x for x in known if x.get(ratio_iv)]
    if bounded:
        # overlapping the band: consistent with the bar; inside it: the bar shown to hold
        apart = [x["scheme"] for x in bounded if x[ratio_iv][1] < 1 / 1.5 or x[ratio_iv][0] > 1.5]
        inside = sum(1 / 1.5 <= x[ratio_iv][0] and x[ratio_iv][1] <= 1.5 for x in bounded)
        verdict += (f"; ratio intervals overlapping [0.67, 1.5]: {len(bounded) - len(apart)} of {len(bounded)}"
                    + (f" (not: {', '.join(apart)})" if apart else "") + f", inside it: {inside}")
    elif any(iv in x for x in known):
        verdict += "; no ratio is bounded (every second-text interval reaches 0)"
    return lines + [verdict]


def format_long_context(rows: list[dict]) -> str:
    """The long-context rows: bits at the window and what they are spent on, perplexity, mean KL from full
    precision, top-8 recall."""
    lines = [f"\nLong context ({rows[0]['tokens']} tokens; bits at the window = codes + metadata + outliers + the "
             "full-precision sinks, recent window and open block at 16 bits; KL: mean over positions, nats)",
             f"{'scheme':22s} {'bits':>5s} {'codes':>6s} {'meta':>5s} {'outl':>5s} {'fp16':>5s} {'ppl':>9s} "
             f"{'delta':>8s} {'KL':>7s} {'top-8':>6s}"]
    for x in rows:
        parts = x["bits_parts"]
        cells = " ".join(f"{parts.get(k, 0.0):{w}.2f}" for k, w in
                         (("codes", 6), ("metadata", 5), ("outliers", 5), ("full_precision", 5)))
        lines.append(f"{x['scheme']:22s} {x['bits_at_window']:5.2f} {cells} {x['ppl']:9.3f} {x['delta']:+8.3f} "
                     f"{x['kl']:7.4f} {x['top8_recall']:6.3f}")
    return "\n".join(lines)


def format_localization(results: list[dict]) -> str:
    """The localization table: per scheme and length, exact answers with their 95% Wilson interval, mean
    log p(right rate), and its change from full precision over the same needles with a 95% interval."""
    lines = [("Localization (penalty rate of Article k): exact answers with their 95% Wilson interval, "
              "mean log p(right rate), and its mean change from full precision over the same needles with its "
              "95% interval (nats)")]
    lengths = sorted({x["length"] for x in results})
    width = max([16] + [len(x["scheme"]) for x in results])  # (allocation rows are long names)
    lines.append(f"{'scheme':{width}s} " + " ".join(f"{n:>44d}" for n in lengths))
    mean = lambda xs: sum(x["logprob"] for x in xs) / len(xs)  # noqa: E731
    rows = lambda name, n: [x for x in results if x["scheme"] == name and x["length"] == n]  # noqa: E731
    for name in dict.fromkeys(x["scheme"] for x in results):
        cells = []
        for n in lengths:
            xs, fp = rows(name, n), rows(FULL, n)
            k = sum(x["exact"] for x in xs)
            lo, hi = localization.wilson(k, len(xs))
            gap, g_lo, g_hi = localization.paired_gap(xs, fp)
            cells.append(f"{k:2d}/{len(xs)} [{lo:.2f},{hi:.2f}] {mean(xs):6.2f} {gap:+5.2f} [{g_lo:+.2f},{g_hi:+.2f}]")
        lines.append(f"{name:{width}s} " + " ".join(f"{c:>44s}" for c in cells))
    return "\n".join(lines)


def format_tables(r: dict) -> str:
    """The printed report: every table the results `r` hold."""
    lines = [f"\nfull precision perplexity: {r['full_precision_ppl']:.3f}"]
    if r["reproduction"]:
        lines.append("\nReproduction of the reference fake-quant protocol (every position quantized, fp32 metadata)")
        lines.append(f"{'keys':34s} {'bits':>4s} {'ppl':>9s} {'reference':>9s} {'dev':>7s} {'ok':>3s} "
                     f"{'eager attention (rows off the reference)':>9s}")
        for x in r["reproduction"]:
            ref = x.get("reference")
            line = (f"{x['row']:34s} {x['bits']:4d} {x['ppl']:9.3f} " +
                    (f"{ref:9.2f} {x['deviation']:+7.1%} {'yes' if x['within_tolerance'] else 'NO':>3s}" if ref
                     else f"{'-':>9s} {'-':>7s} {'-':>3s}"))
            if "ppl_eager" in x:
                line += f" {x['ppl_eager']:9.3f} ({x['ppl_eager'] / x['reference'] - 1:+.1%})"
            lines.append(line)
    lines.append("\nSchemes as served (cache view, fp16 metadata)")
    lines.append(f"{'scheme':14s} {'bits/el':>7s} {'@window':>7s} {'ppl':>9s} {'delta':>8s} {'cos':>7s} {'top8':>6s}  layout")

    def measured(x, layout=None):  # a row of the schemes table (and of the allocations below it)
        if layout is None:  # the scheme's, as its description names it
            layout = x["description"].split(": ", 1)[1].split(" = ")[0]
        return (f"{x['scheme']:14s} {x['bits_per_element']:7.2f} {x['bits_at_window']:7.2f} {x['ppl']:9.3f} "
                f"{x['delta']:+8.3f} {x['attention_cosine']:7.4f} {x['top8_recall']:6.3f}  {layout}")

    lines += [measured(x) for x in r["schemes"]]
    if r.get("eight_bits"):
        lines.append("\nAt 8 bits: vLLM's own fp8 cache as it runs without calibrated scales (--kv-cache-dtype fp8)")
        lines += [measured(x) for x in r["eight_bits"]]
    if r.get("allocation"):
        lines.append(f"\nPer-layer allocation (K/V bits by layer, solved on the sensitivity measured on "
                     f"{r['allocation'][0]['calibration']}; rkv's layout at every layer; rkv-split: every layer the same "
                     "key + value bits, pages of one size)")
        for x in r["allocation"]:
            lines.append(measured(x, x["allocation"]))
    if r.get("second_text"):
        lines.append(format_second_text(r["second_text"]))
    if r.get("long_context"):
        lines.append(format_long_context(r["long_context"]))
    if r["localization"]:
        lines.append("\n" + format_localization(r["localization"]))
    if r["decode_protocol"]:
        lines.append("\nDecode protocol (token by token through the real cache and fused kernel) vs simulation; "
                     f"full precision on this window: {r['decode_window_full_precision_ppl']:.4f}")
        for x in r["decode_protocol"]:
            lines.append(f"{x['scheme']:20s} {x['tokens']:5d} tokens ({x['quantized_tokens']:4d} quantized at the end)  "
                         f"simulated {x['simulated_ppl']:9.4f}  decoded {x['decoded_ppl']:9.4f}  "
                         f"({x['relative_difference']:+.2e})")
    if r.get("chunked_prefill"):
        lines.append("\nChunked prefill (the text fed in chunks through RKVCache; later chunks read the quantized "
                     "cache, themselves in full precision) against token by token")
        lines.append(f"{'scheme':10s} {'chunk':>6s} {'ppl':>9s} {'delta':>8s} {'token by token':>15s} "
                     f"{'goal (+10%)':>11s}")
        for x in r["chunked_prefill"]:
            lines.append(f"{x['scheme']:10s} {x['chunk']:6d} {x['ppl']:9.3f} {x['delta']:+8.3f} "
                         f"{x['token_by_token']:+15.3f} {'met' if x['within_goal'] else 'NOT MET':>11s}")
    for x in r.get("peers", []):
        lines.append(f"peer {x['peer']:26s} " + (f"decoded ppl {x['decoded_ppl']:9.4f} on {x['tokens']} tokens"
                                                  if "decoded_ppl" in x else x["error"]))
    return "\n".join(lines)
