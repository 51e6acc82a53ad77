// CPU op rkv::decode_attention: one query token per sequence against the quantized cache.
//
// This file is the op around the kernel (attention_kernel.h, compiled per instruction set and chosen by
// capability.h): checks, the query transform, the split policy, threads and scratch, and the merge. A
// second pass merges the splits of each query head in split order, so the result does not depend on
// the thread count.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

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
    default: return FloatKind::BF16;  // the checks admit these three only
  }
}

// Tokens per split when the caller leaves it to the kernel: the power of two in [512, 2048] nearest
// above what makes kTargetItems work items (sequence, kv head, split). Longer splits cost fewer partial
// results to zero and merge, and restart fewer prefetch streams; the items still outnumber the cores,
// and power-of-two splits of power-of-two contexts share out evenly. A function of the shapes only,
// never of the thread count, so results stay bit-identical across thread counts.
int64_t default_split_tokens(int64_t rows, int64_t max_n) {
  constexpr int64_t kTargetItems = 32, kMin = 512, kMax = 2048;
  const int64_t want = (rows * max_n + kTargetItems - 1) / kTargetItems;
  int64_t split = kMin;
  while (split < want && split < kMax) split *= 2;
  return split;
}

// out (B, Hq, D) = merge of the splits of every query head, in split order.
void merge_splits(const DecodeArgs& a, float* out) {
  const DecodeGeometry& g = a.g;
  const int64_t D = g.dim, rows = g.batch * g.q_heads;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      SoftmaxPartial total{-INFINITY, 0.0f};
      float* o = out + r * D;
      std::fill(o, o + D, 0.0f);
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
      const float inv = total.l > 0.0f ? 1.0f / total.l : 0.0f;  // no cached token: zero output
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) o[c] *= inv;
    }
  });
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
                                const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                                const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                                const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                                const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                                int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
                                const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                                const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                                double scale, int64_t split_tokens) {
  DecodeGeometry g = check_decode_attention(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window,
                                            v_window, k_sink, v_sink, lengths, k_bits, v_bits, block, recent,
                                            rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, split_tokens);
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  check_decode_lengths(g, len);
  // queries in fp32, pre-scaled, and rotated into the keys' Hadamard space
  const at::Tensor qf = decode_query(q, scale, k_signs);
  const at::Tensor cos = rope_cos.has_value() ? rope_cos->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor sin = rope_sin.has_value() ? rope_sin->to(at::kFloat).contiguous() : at::Tensor();

  const int64_t max_n = g.batch ? *std::max_element(len.const_data_ptr<int64_t>(), len.const_data_ptr<int64_t>() + g.batch) : 0;
  if (split_tokens == 0) g.split_tokens = default_split_tokens(g.batch * g.kv_heads, max_n);
  DecodeArgs a;
  a.g = g;
  a.fp = float_kind(k_window.scalar_type());
  a.meta = float_kind(k_scale.scalar_type());
  a.splits = std::max<int64_t>(1, (max_n + g.split_tokens - 1) / g.split_tokens);
  at::Tensor part_ml = at::empty({g.batch, g.q_heads, a.splits, 2}, qf.options());
  at::Tensor part_acc = at::empty({g.batch, g.q_heads, a.splits, g.dim}, qf.options());
  a.q = qf.const_data_ptr<float>();
  a.lengths = len.const_data_ptr<int64_t>();
  a.cos = cos.defined() ? cos.const_data_ptr<float>() : nullptr;
  a.sin = sin.defined() ? sin.const_data_ptr<float>() : nullptr;
  a.part_ml = part_ml.mutable_data_ptr<float>();
  a.part_acc = part_acc.mutable_data_ptr<float>();

  // contiguous buffers that stay alive until the kernel is done
  const auto c = [](const at::Tensor& t) { return t.contiguous(); };
  const at::Tensor kp = c(k_packed), ks = c(k_scale), vp = c(v_packed), vs = c(v_scale);
  const at::Tensor kz = k_zero.has_value() ? c(*k_zero) : at::Tensor();
  const at::Tensor vz = v_zero.has_value() ? c(*v_zero) : at::Tensor();
  const at::Tensor kw = c(k_window), vw = c(v_window), kk = c(k_sink), vk = c(v_sink);
  const auto side = [](const at::Tensor& p, const at::Tensor& s, const at::Tensor& z, const at::Tensor& w,
                       const at::Tensor& sk) {
    return CachedSide{p.const_data_ptr<uint8_t>(), s.const_data_ptr(), z.defined() ? z.const_data_ptr() : nullptr,
                      w.const_data_ptr(), sk.const_data_ptr()};
  };
  a.k = side(kp, ks, kz, kw, kk);
  a.v = side(vp, vs, vz, vw, vk);

  const DecodeItems kernel = capability() == Capability::Avx2 ? decode_items_avx2(g.dim) : decode_items_default(g.dim);
  const int64_t items = g.batch * g.kv_heads * a.splits;
  const int64_t scratch_floats = ScratchLayout(g).total;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(scratch_floats, 0.0f);
    kernel(a, begin, end, scratch.data());
  });
  at::Tensor out = at::empty({g.batch, g.q_heads, g.dim}, qf.options());
  merge_splits(a, out.mutable_data_ptr<float>());
  return decode_output(out, v_signs, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }

}  // namespace rkv::cpu
