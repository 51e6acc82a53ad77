// The cache ops' entry points, written once for both backends: each resolves its call (cache_call.h)
// and hands it to the backend's runner. cpu/attention.cpp and cuda/attention.cu register them with their
// run_attention, cpu/cache.cpp and cuda/cache.cu with their run_append.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "cache_call.h"
#include "op_common.h"

namespace rkv {

// The fp32 output (query tokens, Hq, D) of one attention call, still in the values' Hadamard space.
using AttentionRunner = at::Tensor (*)(AttentionCall& call);
// Writes one append; `op` names it in errors.
using AppendRunner = void (*)(const char* op, const AppendCall& call);

template <AttentionRunner Run>
at::Tensor decode_attention_op(const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
                               const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                               const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                               const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                               const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                               int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
                               const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                               const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                               double scale, int64_t split_tokens, int64_t sliding_window, double softcap,
                               const std::optional<at::Tensor>& k_levels, const std::optional<at::Tensor>& v_levels,
                               const std::optional<at::Tensor>& k_outliers,
                               const std::optional<at::Tensor>& v_outliers,
                               const std::optional<at::Tensor>& sink_logits,
                               const std::optional<at::Tensor>& k_refine,
                               const std::optional<at::Tensor>& k_channels) {
  const CacheTensors c{k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       &k_levels, &v_levels, &k_outliers, &v_outliers, &k_refine, &k_channels};
  const char* op = "decode_attention";
  AttentionCall call = decode_call(op, q, c, CacheIndex{}, lengths, k_bits, v_bits, block, recent,
                                   rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, scale, split_tokens,
                                   sliding_window, softcap);
  attach_sink_logits(op, call, sink_logits);
  return decode_output(Run(call), v_signs, q.scalar_type());
}

template <AttentionRunner Run>
at::Tensor paged_decode_attention_op(const at::Tensor& q, const at::Tensor& k_codes, const at::Tensor& k_scale,
                                     const std::optional<at::Tensor>& k_zero, const at::Tensor& v_codes,
                                     const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                                     const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                                     const at::Tensor& v_sink, const std::optional<at::Tensor>& block_tables,
                                     const std::optional<at::Tensor>& side_slots, const at::Tensor& lengths,
                                     int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                                     const std::optional<at::Tensor>& rope_cos,
                                     const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                                     const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                                     double scale, int64_t split_tokens, int64_t sliding_window, double softcap,
                                     const std::optional<at::Tensor>& k_levels,
                                     const std::optional<at::Tensor>& v_levels,
                                     const std::optional<at::Tensor>& k_outliers,
                                     const std::optional<at::Tensor>& v_outliers,
                                     const std::optional<at::Tensor>& sink_logits,
                               const std::optional<at::Tensor>& k_refine,
                               const std::optional<at::Tensor>& k_channels) {
  const CacheTensors c{k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       &k_levels, &v_levels, &k_outliers, &v_outliers, &k_refine, &k_channels};
  const CacheIndex ix{&block_tables, &side_slots, true};
  const char* op = "paged_decode_attention";
  AttentionCall call = decode_call(op, q, c, ix, lengths, k_bits, v_bits, block, recent,
                                   rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, scale, split_tokens,
                                   sliding_window, softcap);
  attach_sink_logits(op, call, sink_logits);
  return decode_output(Run(call), v_signs, q.scalar_type());
}

template <AttentionRunner Run>
at::Tensor paged_prefill_attention_op(
    const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& query_start_loc,
    int64_t max_query_len, const at::Tensor& k_codes, const at::Tensor& k_scale,
    const std::optional<at::Tensor>& k_zero, const at::Tensor& v_codes, const at::Tensor& v_scale,
    const std::optional<at::Tensor>& v_zero, const at::Tensor& k_window, const at::Tensor& v_window,
    const at::Tensor& k_sink, const at::Tensor& v_sink, const std::optional<at::Tensor>& block_tables,
    const std::optional<at::Tensor>& side_slots, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
    int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
    const std::optional<at::Tensor>& rope_sin, bool rope_interleaved, const std::optional<at::Tensor>& k_signs,
    const std::optional<at::Tensor>& v_signs, double scale, int64_t split_tokens, int64_t sliding_window,
    double softcap, const std::optional<at::Tensor>& k_levels, const std::optional<at::Tensor>& v_levels,
    const std::optional<at::Tensor>& k_outliers, const std::optional<at::Tensor>& v_outliers,
    const std::optional<at::Tensor>& sink_logits, const std::optional<at::Tensor>& k_refine,
    const std::optional<at::Tensor>& k_channels) {
  const CacheTensors c{k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       &k_levels, &v_levels, &k_outliers, &v_outliers, &k_refine, &k_channels};
  const CacheIndex ix{&block_tables, &side_slots, true};
  AttentionCall call = prefill_call(q, k_new, v_new, query_start_loc, max_query_len, c, ix, lengths, k_bits, v_bits,
                                    block, recent, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, scale,
                                    split_tokens, sliding_window, softcap);
  attach_sink_logits("paged_prefill_attention", call, sink_logits);
  return decode_output(Run(call), v_signs, q.scalar_type());
}

template <AppendRunner Run>
void cache_append_op(const at::Tensor& k_packed, const at::Tensor& k_scale, const std::optional<at::Tensor>& k_zero,
                     const at::Tensor& v_packed, const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                     const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                     const at::Tensor& v_sink, const at::Tensor& lengths, const at::Tensor& k_new,
                     const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                     bool k_clip, bool v_clip, int64_t sliding_window,
                     const std::optional<at::Tensor>& k_levels, const std::optional<at::Tensor>& v_levels,
                     const std::optional<at::Tensor>& k_outliers, const std::optional<at::Tensor>& v_outliers,
                     const std::optional<at::Tensor>& k_refine, const std::optional<at::Tensor>& k_channels) {
  const CacheTensors c{k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       &k_levels, &v_levels, &k_outliers, &v_outliers, &k_refine, &k_channels};
  Run("cache_append", contiguous_append_call(c, lengths, k_new, v_new, k_bits, v_bits, block, recent, k_clip, v_clip,
                                             sliding_window));
}

template <AppendRunner Run>
void paged_append_op(const at::Tensor& k_codes, const at::Tensor& k_scale, const std::optional<at::Tensor>& k_zero,
                     const at::Tensor& v_codes, const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                     const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                     const at::Tensor& v_sink, const std::optional<at::Tensor>& page_fill,
                     const std::optional<at::Tensor>& block_tables, const std::optional<at::Tensor>& side_slots,
                     const at::Tensor& lengths, const at::Tensor& query_start_loc, const at::Tensor& k_new,
                     const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                     bool k_clip, bool v_clip, const std::optional<at::Tensor>& slot_mapping,
                     const std::optional<at::Tensor>& k_levels, const std::optional<at::Tensor>& v_levels,
                     const std::optional<at::Tensor>& k_outliers, const std::optional<at::Tensor>& v_outliers,
                     const std::optional<at::Tensor>& k_refine, const std::optional<at::Tensor>& k_channels) {
  const CacheTensors c{k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                       &k_levels, &v_levels, &k_outliers, &v_outliers, &k_refine, &k_channels};
  const CacheIndex ix{&block_tables, &side_slots, true};
  Run("paged_append", paged_append_call(c, page_fill, ix, lengths, query_start_loc, k_new, v_new, k_bits, v_bits,
                                        block, recent, k_clip, v_clip, slot_mapping));
}

}  // namespace rkv
