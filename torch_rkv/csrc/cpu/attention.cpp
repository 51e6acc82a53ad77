// CPU ops rkv::decode_attention, rkv::paged_decode_attention and rkv::paged_prefill_attention: query
// tokens against the quantized cache (contiguous or paged; prefill also over the chunk's own tokens).
//
// This file is the ops around the one kernel (attention_kernel.h, compiled per instruction set and
// chosen by capability.h): the call (cache_call.h: checks, addressing, the query transform), the split
// policy, threads and scratch, and the merge. A second pass merges the splits of each query row in split
// order, so the result does not depend on the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "../cache_call.h"
#include "../cache_ops.h"
#include "../checks.h"
#include "../op_common.h"
#include "capability.h"
#include "decode_kernel.h"
#include "rkv/attention.h"

namespace rkv::cpu {
namespace {

FloatKind float_kind(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FloatKind::F32;
    case at::kHalf: return FloatKind::F16;
    case at::kFloat8_e4m3fn: return FloatKind::F8E4M3;  // metadata only
    default: return FloatKind::BF16;  // the checks admit these four only
  }
}

// Tokens per split when the caller leaves it to the kernel. Work items without splits (sequence, query
// block, kv head) that already number kTargetItems take all the keys in one split: no partial results,
// no merge (a prefill chunk). Otherwise the power of two in [512, 2048] nearest above what makes
// kTargetItems items: longer splits cost fewer partial results to zero and merge, and restart fewer
// prefetch streams; the items still outnumber the cores, and power-of-two splits of power-of-two
// contexts share out evenly. A prefill's partial results are (query rows x splits x D) floats, so it
// splits at most n / (10 R) ways (R = max_rows, the query rows of its longest chunk per kv head): for
// the longest sequence they stay under a twentieth of its dequantized prefix (2 n D per kv head),
// whatever the chunk, and a few query tokens (speculative verification) still split a long prefix; fewer
// items than kTargetItems may idle a many-core machine on one long chunk (2 cores do not). A function
// of the shapes and lengths only, never of the thread count, so results stay bit-identical across
// thread counts.
int64_t default_split_tokens(int64_t items, int64_t max_n, int64_t max_rows) {
  constexpr int64_t kTargetItems = 32, kMin = 512, kMax = 2048;
  if (items >= kTargetItems) return std::max<int64_t>(1, max_n);
  const int64_t want = (items * max_n + kTargetItems - 1) / kTargetItems;
  int64_t split = kMin;
  while (split < want && split < kMax) split *= 2;
  if (max_rows > 0) {
    const int64_t max_splits = std::max<int64_t>(1, max_n / (10 * max_rows));
    split = std::max(split, (max_n + max_splits - 1) / max_splits);
  }
  return split;
}

// out (query tokens, Hq, D) = merge of the splits of every query row, in split order; rows from `rows`
// on (padding past query_start_loc[B]) are zeros.
void merge_splits(const AttentionArgs& a, int64_t rows, int64_t total_rows, float* out) {
  const int64_t D = a.g.dim;
  at::parallel_for(0, total_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* o = out + r * D;
      std::fill(o, o + D, 0.0f);
      if (r >= rows) continue;
      SoftmaxPartial total{-INFINITY, 0.0f};
      for (int64_t s = 0; s < a.splits; ++s) {
        const float* ml = a.part_ml + (r * a.splits + s) * 2;
        const float* acc = a.part_acc + (r * a.splits + s) * D;
        SoftmaxPartial merged;
        float fa, fb;
        softmax_merge_factors(total, SoftmaxPartial{ml[0], ml[1]}, merged, fa, fb);
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) o[c] = o[c] * fa + acc[c] * fb;
        total = merged;
      }
      const float inv = softmax_normalizer(total, a.sink_logit(r));
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) o[c] *= inv;
    }
  });
}

// Runs the kernel over every work item and merges: the output (query tokens, Hq, D) in fp32, still in
// the values' Hadamard space.
at::Tensor run_attention(AttentionCall& call) {
  CacheGeometry& g = call.cache.g;
  const int64_t* len = call.cache.lengths.const_data_ptr<int64_t>();
  const bool prefill = call.q_start.defined();
  const int64_t* q_start = prefill ? call.q_start.const_data_ptr<int64_t>() : nullptr;
  std::vector<int64_t> counts;
  if (prefill) {
    counts = token_counts(call.q_start);
    TORCH_CHECK_VALUE(g.batch == 0 || (q_start[0] >= 0 && q_start[g.batch] <= call.q.size(0)),
                      "rkv.paged_prefill_attention: query_start_loc must lie in [0, ", call.q.size(0), "] (the rows of q)");
    for (int64_t b = 0; b < g.batch; ++b)
      TORCH_CHECK_VALUE(counts[b] <= call.max_query_len, "rkv.paged_prefill_attention: sequence ", b, " has ",
                        counts[b], " new tokens, more than max_query_len (", call.max_query_len, ")");
  }
  check_cache_data(prefill ? "paged_prefill_attention" : (call.cache.tables.defined() || call.cache.slots.defined()
                                                              ? "paged_decode_attention" : "decode_attention"),
                   g, call.cache.pt, len, prefill ? counts.data() : nullptr);
  int64_t max_total = 0, max_m = prefill ? 0 : 1;
  for (int64_t b = 0; b < g.batch; ++b) {
    max_total = std::max(max_total, len[b] + (prefill ? counts[b] : 0));
    if (prefill) max_m = std::max(max_m, counts[b]);
  }
  max_total = split_span(max_total, max_m, g.sliding_window);  // the keys a sequence's splits cover
  AttentionArgs a;
  a.q_block = prefill ? std::max<int64_t>(1, prefill_rows(g.dim) / g.group_size()) : 1;
  a.q_blocks = std::max<int64_t>(1, (max_m + a.q_block - 1) / a.q_block);
  if (g.split_tokens == 0)
    g.split_tokens = default_split_tokens(g.batch * g.kv_heads * a.q_blocks, max_total,
                                          prefill ? max_m * g.group_size() : 0);
  g.split_tokens = std::max<int64_t>(1, std::min(g.split_tokens, std::max<int64_t>(1, max_total)));
  a.g = g;
  a.pt = call.cache.pt;
  a.fp = float_kind(call.cache.fp);
  a.k_meta = float_kind(call.cache.k_meta);
  a.v_meta = float_kind(call.cache.v_meta);
  a.k = call.cache.k;
  a.v = call.cache.v;
  a.q = call.q.const_data_ptr<float>();
  a.lengths = len;
  a.q_start = q_start;
  a.k_fresh = prefill ? call.k_fresh.const_data_ptr() : nullptr;
  a.v_fresh = prefill ? call.v_fresh.const_data_ptr() : nullptr;
  a.cos = call.cos.defined() ? call.cos.const_data_ptr<float>() : nullptr;
  a.sin = call.sin.defined() ? call.sin.const_data_ptr<float>() : nullptr;
  a.sink_logits = call.sink_logits.defined() ? call.sink_logits.const_data_ptr<float>() : nullptr;
  a.splits = std::max<int64_t>(1, (max_total + g.split_tokens - 1) / g.split_tokens);
  const int64_t query_tokens = call.q.size(0), rows = prefill ? (g.batch ? q_start[g.batch] : 0) : g.batch;
  at::Tensor out = at::empty({query_tokens, g.q_heads, g.dim}, call.q.options());
  // one split: the items write the outputs (no partial results); rows past the real ones are padding
  at::Tensor part_ml, part_acc;
  if (a.splits == 1) {
    a.out = out.mutable_data_ptr<float>();
    out.narrow(0, rows, query_tokens - rows).zero_();
  } else {
    part_ml = at::empty({query_tokens, g.q_heads, a.splits, 2}, call.q.options());
    part_acc = at::empty({query_tokens, g.q_heads, a.splits, g.dim}, call.q.options());
    a.part_ml = part_ml.mutable_data_ptr<float>();
    a.part_acc = part_acc.mutable_data_ptr<float>();
  }

  const AttentionItems kernel =
      capability() == Capability::Avx2 ? attention_items_avx2(g.dim) : attention_items_default(g.dim);
  const int64_t items = g.batch * a.q_blocks * a.splits * g.kv_heads;
  const int64_t scratch_floats = ScratchLayout(a).total;
  // Items differ in size (ragged lengths, causal query blocks): each thread takes the next kv heads of a
  // split from a shared counter until none is left, instead of a fixed share. Which thread runs an item
  // never changes its result.
  std::atomic<int64_t> next{0};
  const int64_t grain = g.kv_heads;
  at::parallel_for(0, std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (items + grain - 1) / grain)), 1,
                   [&](int64_t, int64_t) {
                     std::vector<float> scratch(scratch_floats, 0.0f);
                     for (int64_t it = next.fetch_add(grain); it < items; it = next.fetch_add(grain))
                       kernel(a, it, std::min(items, it + grain), scratch.data());
                   });
  if (a.splits > 1) merge_splits(a, rows * g.q_heads, query_tokens * g.q_heads, out.mutable_data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) {
  m.impl("decode_attention", &decode_attention_op<run_attention>);
  m.impl("paged_decode_attention", &paged_decode_attention_op<run_attention>);
  m.impl("paged_prefill_attention", &paged_prefill_attention_op<run_attention>);
}

}  // namespace rkv::cpu
