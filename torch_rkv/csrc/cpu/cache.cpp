// CPU kernel of rkv::cache_append: write new tokens into a quantized cache in place.
//
// Per (sequence, kv head), for keys and values alike (reference.cache_append):
//   1. every block the append completes is quantized, its older tokens read from the window ring and
//      its newer ones from the new tokens, with the block quantizer of rkv::quantize (bit-identical);
//   2. new tokens t < S go to the sinks, new tokens that stay in full precision to the window ring.
// Step 1 reads ring slots that step 2 may overwrite, so it runs first. All checks (shapes, dtypes,
// capacity of every sequence) happen before the first write: a rejected call changes nothing.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../append_side.h"
#include "../checks.h"
#include "../dispatch.h"
#include "block_quant.h"
#include "rkv/attention.h"

namespace rkv::cpu {
namespace {

template <typename fp_t, typename meta_t>
void append_one(const DecodeGeometry& g, const AppendSide<fp_t, meta_t>& a, int64_t bh, int64_t n0, int64_t m,
                BlockScratch& scratch) {
  const int64_t d = g.dim, S = g.sinks, W = g.window, n1 = n0 + m, rb = d * a.bits / 8, ng = d / a.group;
  const int64_t q0 = quantized_count(n0, S, g.recent, g.block), q1 = quantized_count(n1, S, g.recent, g.block);
  const fp_t* fresh = a.fresh + bh * m * d;
  fp_t* window = a.window + bh * W * d;
  const auto token = [&](int64_t t) -> const fp_t* {
    return t < n0 ? window + window_slot(t, S, W) * d : fresh + (t - n0) * d;
  };
  // 1. completed blocks, one quantizer tile (block_tokens rows) at a time
  for (int64_t s = q0; s < q1; s += a.block_tokens) {
    const int64_t first = S + s;  // token of the tile's first row
    quantize_block_row<fp_t, meta_t>(
        [&](int64_t i) { return token(first + i); },
        [&](int64_t i) { return a.packed + (bh * g.capacity + s + i) * rb; }, a.block_tokens, d, a.group, a.bits,
        a.zero == nullptr, a.clip, a.scale + (bh * (g.capacity / a.block_tokens) + s / a.block_tokens) * ng,
        a.zero ? a.zero + (bh * (g.capacity / a.block_tokens) + s / a.block_tokens) * ng : nullptr, scratch);
  }
  // 2. sinks and window
  for (int64_t t = n0; t < n1; ++t) {
    if (t < S) {
      std::memcpy(a.sink + (bh * S + t) * d, fresh + (t - n0) * d, d * sizeof(fp_t));
    } else if (t >= S + q1) {
      std::memcpy(window + window_slot(t, S, W) * d, fresh + (t - n0) * d, d * sizeof(fp_t));
    }
  }
}

void cache_append_cpu(const at::Tensor& k_packed, const at::Tensor& k_scale, const std::optional<at::Tensor>& k_zero,
                      const at::Tensor& v_packed, const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                      const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                      const at::Tensor& v_sink, const at::Tensor& lengths, const at::Tensor& k_new,
                      const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                      bool k_clip, bool v_clip) {
  const DecodeGeometry g = check_cache_append(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window,
                                              k_sink, v_sink, lengths, k_new, v_new, k_bits, v_bits, block, recent,
                                              k_clip, v_clip);
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  const int64_t m = k_new.size(2);
  check_append_lengths(g, len, m);
  if (m == 0 || g.batch == 0) return;
  const at::Tensor kn = k_new.contiguous(), vn = v_new.contiguous();
  RKV_DISPATCH_FLOAT(k_window.scalar_type(), "rkv.cache_append", fp_t, [&] {
    RKV_DISPATCH_FLOAT(k_scale.scalar_type(), "rkv.cache_append", meta_t, [&] {
      const auto ks = append_side<fp_t, meta_t>(k_packed, k_scale, k_zero, k_window, k_sink, kn, g.k_block_tokens,
                                                g.k_group, k_bits, k_clip);
      const auto vs = append_side<fp_t, meta_t>(v_packed, v_scale, v_zero, v_window, v_sink, vn, g.v_block_tokens,
                                                g.v_group, v_bits, v_clip);
      const int64_t* n = len.const_data_ptr<int64_t>();
      at::parallel_for(0, g.batch * g.kv_heads, 1, [&](int64_t begin, int64_t end) {
        BlockScratch k_scratch(g.k_block_tokens, g.dim / g.k_group, g.dim);
        BlockScratch v_scratch(g.v_block_tokens, g.dim / g.v_group, g.dim);
        for (int64_t bh = begin; bh < end; ++bh) {
          append_one(g, ks, bh, n[bh / g.kv_heads], m, k_scratch);
          append_one(g, vs, bh, n[bh / g.kv_heads], m, v_scratch);
        }
      });
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) { m.impl("cache_append", &cache_append_cpu); }

}  // namespace rkv::cpu
