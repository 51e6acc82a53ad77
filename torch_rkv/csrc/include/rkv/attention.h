// Attention math shared by the CPU and CUDA kernels: where a cached token lives, the exponential, and
// the exact merge of partial softmax results (flash-decoding).
//
// Per sequence of n cached tokens, as reference.py ("The quantized KV cache"):
//   t < S                    sink row t                 (full precision)
//   S <= t < Q(n)            quantized row              (page tables[b][t / P], row t % P)
//   max(S, Q(n)) <= t < n    window row t % W           (full-precision ring)
//   t >= n                   a new token of the chunk   (prefill attention only)
// Q(n) = block * floor(max(0, n - recent) / block).
#pragma once

#include <cmath>

#include "rkv/macros.h"

namespace rkv {

RKV_HD int64_t quantized_count(int64_t n, int64_t recent, int64_t block) {
  const int64_t over = n - recent;
  return over > 0 ? block * (over / block) : 0;
}

RKV_HD int64_t window_slot(int64_t t, int64_t window) { return t % window; }

// The first key a query row that sees keys [0, end) attends to: a sliding window of `window` keys keeps
// the newest (transformers' and vLLM's semantics: the query itself and the window - 1 before it).
RKV_HD int64_t window_start(int64_t end, int64_t window) { return window > 0 && end > window ? end - window : 0; }

// The first key the splits of a sequence with n cached tokens cover: the earliest any of its query
// rows sees (decode: keys [0, n); prefill: the chunk's first token sees [0, n + 1)).
RKV_HD int64_t split_base(int64_t n, bool prefill, int64_t window) { return window_start(n + (prefill ? 1 : 0), window); }

// How many keys from split_base the splits must cover, for sequences of at most `tokens` keys (cached and
// new) and chunks of at most `max_query` tokens: a sliding window bounds it by window + max_query - 1.
RKV_HD int64_t split_span(int64_t tokens, int64_t max_query, int64_t window) {
  const int64_t bound = window + (max_query > 1 ? max_query : 1) - 1;
  return window > 0 && bound < tokens ? bound : tokens;
}

// Quantized rows of a ring (a sliding-window layer's contiguous cache): an append writes each block's
// rows once the block is complete (while its tokens are still read from the full-precision ring), so the
// rows written end at block * floor(n / block) <= n, and a query reads from n - window on: the newest
// `window` rows, in whole blocks (reference.ring_rows is the same rule).
RKV_HD int64_t ring_rows(int64_t window, int64_t block) { return (window + block - 1) / block * block; }

// Gemma 2's attention-logit soft-capping of a (scaled) score; cap <= 0: none.
RKV_HD float softcap_score(float s, float cap) { return cap > 0.0f ? cap * tanhf(s / cap) : s; }

// Where token t of a sequence with `cached` tokens (q_count of them in quantized blocks) is read.
enum class Place { Sink, Packed, Window, Fresh };
RKV_HD Place token_place(int64_t t, int64_t sinks, int64_t q_count, int64_t cached) {
  if (t >= cached) return Place::Fresh;
  return t < sinks ? Place::Sink : (t < q_count ? Place::Packed : Place::Window);
}

// exp(x) for the softmax, x <= 0. CUDA: the library expf. CPU: a branch-free polynomial (relative
// error < 5e-7 on [-87, 0]) so softmax loops vectorize; libm's expf is a call per element.
RKV_HD float softmax_exp(float x) {
#if RKV_DEVICE_CODE
  return expf(x);
#else
  x = x < -87.0f ? -87.0f : x;
  // x = n ln2 + r with |r| <= ln2 / 2 (Cody-Waite: n * kLn2Hi is exact), e^x = 2^n e^r
  const float n = rintf(x * 1.44269504088896341f);
  const float r = sub_rn(sub_rn(x, mul_rn(n, 0.693145751953125f)), mul_rn(n, 1.428606765330187e-6f));
  // e^r: Taylor to degree 6, truncation error < 1.2e-7 for |r| <= 0.347
  float p = 1.0f / 720.0f;
  p = fma_f(p, r, 1.0f / 120.0f);
  p = fma_f(p, r, 1.0f / 24.0f);
  p = fma_f(p, r, 1.0f / 6.0f);
  p = fma_f(p, r, 0.5f);
  p = fma_f(p, r, 1.0f);
  p = fma_f(p, r, 1.0f);
  const float two_n = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);  // n >= -126
  return p * two_n;
#endif
}

// A partial softmax over a subset of keys: running max m, sum l of exp(s - m), and the
// un-normalized output acc (kept by the caller). Merging two states is exact.
struct SoftmaxPartial {
  float m;
  float l;
};

// Rescale factors to merge (m_a, l_a) and (m_b, l_b): out = fa * a + fb * b.
RKV_HD void softmax_merge_factors(SoftmaxPartial a, SoftmaxPartial b, SoftmaxPartial& merged, float& fa, float& fb) {
  const float m = a.m > b.m ? a.m : b.m;
  fa = a.l > 0.0f ? softmax_exp(a.m - m) : 0.0f;
  fb = b.l > 0.0f ? softmax_exp(b.m - m) : 0.0f;
  merged.m = m;
  merged.l = a.l * fa + b.l * fb;
}

// The factor that normalizes a row's un-normalized output once all its keys are merged (total), with a
// learned attention sink (GPT-OSS): one more logit in the softmax, with no value, so it only adds to the
// sum; sink = -inf: none, and then exactly 1 / total.l. out = acc * factor: no cached token gives zeros,
// and a NaN sum (NaN in a full-precision key) a NaN output through acc.
RKV_HD float softmax_normalizer(SoftmaxPartial total, float sink) {
  SoftmaxPartial merged;
  float fa, fb;
  softmax_merge_factors(total, SoftmaxPartial{sink, sink == -INFINITY ? 0.0f : 1.0f}, merged, fa, fb);
  return merged.l > 0.0f ? fa / merged.l : 0.0f;
}

// The sink logit of output row `row` of (query tokens, Hq) rows: sink_logits (Hq,), or nullptr: -inf (none).
RKV_HD float row_sink_logit(const float* sink_logits, int64_t row, int64_t q_heads) {
  return sink_logits != nullptr ? sink_logits[row % q_heads] : -INFINITY;
}

}  // namespace rkv
