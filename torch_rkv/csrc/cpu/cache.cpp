// CPU kernel of rkv::cache_append (the contiguous layout) and rkv::paged_append (pages): write new
// tokens into a quantized cache in place.
//
// Per (sequence, kv head), for keys and values alike (reference.paged_append):
//   1. every block the append completes is quantized, its older tokens read from the sinks and the
//      window ring and its newer ones from the new tokens, with the block quantizer of rkv::quantize
//      (bit-identical), into its page rows;
//      With sparse outliers the block's are chosen first (cpu/outliers.h) and stored after it;
//   2. new tokens t < S go to the sinks, new tokens that stay in full precision to the window ring.
// Step 1 reads ring slots that step 2 may overwrite, so it runs first. All checks (shapes, dtypes,
// capacity, page ids, the immutability of quantized rows) happen before the first write: a rejected
// call changes nothing.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "../cache_call.h"
#include "../cache_ops.h"
#include "../dispatch.h"
#include "block_quant.h"
#include "outliers.h"
#include "rkv/attention.h"
#include "rkv/paging.h"

namespace rkv::cpu {
namespace {

// Per-thread scratch of refined key channels: which channels of the kv head keep their full range, and one
// row's codes.
struct RefineScratch {
  std::vector<uint8_t> unclipped, codes;
  int64_t head = -1;  // the kv head `unclipped` was set for
  RefineScratch(const SideView& side, int64_t dim)
      : unclipped(side.refine != nullptr ? dim : 0), codes(side.refine != nullptr ? side.refine_count : 0) {}
  // The flags of kv head h's refined channels, set when a block of another head completes (not per append
  // call: most decode steps complete none).
  const uint8_t* unclipped_of(const SideView& side, int64_t h) {
    if (head != h) {
      std::fill(unclipped.begin(), unclipped.end(), 0);
      for (int64_t j = 0; j < side.refine_count; ++j) unclipped[side.channels[h * side.refine_count + j]] = 1;
      head = h;
    }
    return unclipped.data();
  }
};

// The refinement codes of quantizer tile rows [s, s + T) of kv head h, from the tile's float values and
// parameters that quantize_block_row leaves in its scratch, packed into their page rows.
void write_refined(const CacheGeometry& g, const SideView& side, const BlockScratch& tile, int64_t page, int64_t h,
                   int64_t row, int64_t T, RefineScratch& rs) {
  const int32_t* ch = side.channels + h * side.refine_count;
  for (int64_t i = 0; i < T; ++i) {
    const float* x = tile.x.data() + i * g.dim;
    for (int64_t j = 0; j < side.refine_count; ++j) {
      const int64_t c = ch[j];
      rs.codes[j] = static_cast<uint8_t>(
          refine_code(x[c], QParams{tile.scale[c], tile.zero[c]}, side.bits, side.refine_bits));
    }
    pack_row(rs.codes.data(), side.refine_count, side.refine_bits, side.refine + side.refine_offset(g, page, h, row + i));
  }
}

// Per-thread scratch of the outlier selection: one whole block in float, and its taken flags.
struct OutlierScratch {
  std::vector<float> x;
  std::vector<uint8_t> taken;
  OutlierScratch(int64_t block, int64_t dim, bool used) : x(used ? block * dim : 0) {}
};

template <typename fp_t, typename meta_t>
void append_one(const CacheGeometry& g, const PageTable& pt, const SideView& side, const fp_t* fresh,
                const FreshRows& rows, bool clip, int64_t b, int64_t h, int64_t n0, int64_t m, BlockScratch& scratch,
                OutlierScratch& out, RefineScratch& rs) {
  const int64_t d = g.dim, S = g.sinks, P = g.page_size, T = side.block_tokens, n1 = n0 + m, slot = pt.slot(b);
  const int64_t q1 = quantized_count(n1, g.recent, g.block);
  fp_t* window = static_cast<fp_t*>(side.window);
  fp_t* sink = static_cast<fp_t*>(side.sink);
  meta_t* scale = static_cast<meta_t*>(side.scale);
  meta_t* zero = static_cast<meta_t*>(side.zero);
  const auto token = [&](int64_t t) -> const fp_t* {
    if (t >= n0) return fresh + rows.offset(b, h, t - n0);
    return t < S ? sink + sink_offset(g, slot, h, t) : window + window_offset(g, slot, h, t);
  };
  // 1. completed blocks, one quantizer tile (T rows) at a time; with sparse outliers the block's are
  // chosen first, left out of the tiles' ranges, and stored with their residuals after; refined key
  // channels keep their full range, and their refinement codes follow each tile's codes
  for (int64_t first = n0 / g.block * g.block; first + g.block <= n1; first += g.block) {
    std::vector<int64_t> taken;
    if (side.outliers != nullptr) {
      for (int64_t i = 0; i < g.block; ++i) to_float(token(first + i), out.x.data() + i * d, d);
      const OutlierGroups og{d, T, side.group, sink_rows_in(S, first, g.block)};
      taken = select_outliers(out.x.data(), g.block, og, side.outlier_count, out.taken);
    }
    for (int64_t s = first; s < first + g.block; s += T) {
      const int64_t page = pt.page(b, s), row = s % P, meta = side.meta_offset(g, page, h, row);
      quantize_block_row<fp_t, meta_t>(
          [&](int64_t i) { return token(s + i); },
          [&](int64_t i) { return side.codes + side.codes_offset(g, page, h, row + i); }, T, d, side.group,
          side.bits, zero == nullptr, clip, scale + meta, zero ? zero + meta : nullptr, scratch,
          sink_rows_in(S, s, T), side.levels,
          side.outliers != nullptr ? out.taken.data() + (s - first) * d : nullptr,
          side.refine != nullptr ? rs.unclipped_of(side, h) : nullptr);
      if (side.refine != nullptr) write_refined(g, side, scratch, page, h, row, T, rs);
    }
    if (side.outliers != nullptr) {
      const int64_t page = pt.page(b, first), row0 = first % P;
      const auto x_hat = [&](int64_t pos) { return dense_value<meta_t>(side, g, page, h, row0, pos); };
      write_outliers(out.x.data(), taken, x_hat, side.outlier_count,
                     side.outliers + side.outlier_offset(g, page, h, row0));
    }
  }
  // 2. sinks and window
  for (int64_t t = n0; t < n1; ++t) {
    if (t < S) {
      std::memcpy(sink + sink_offset(g, slot, h, t), token(t), d * sizeof(fp_t));
    } else if (t >= q1) {
      std::memcpy(window + window_offset(g, slot, h, t), token(t), d * sizeof(fp_t));
    }
  }
}

void run_append(const char* op, const AppendCall& a) {
  check_append_data(op, a);
  const CacheGeometry& g = a.cache.g;
  const PageTable& pt = a.cache.pt;
  const int64_t* n = a.cache.lengths.const_data_ptr<int64_t>();
  const int64_t* qs = a.q_start.defined() ? a.q_start.const_data_ptr<int64_t>() : nullptr;
  const auto count = [&](int64_t b) { return qs != nullptr ? qs[b + 1] - qs[b] : a.tokens; };
  if (g.batch == 0) return;
  // keys, then values: each side's metadata has its own dtype
  const auto append_side = [&](const SideView& side, at::ScalarType meta, const at::Tensor& fresh, bool clip,
                               int64_t block_tokens, int64_t group) {
    RKV_DISPATCH_FLOAT(a.cache.fp, "rkv.append", fp_t, [&] {
      RKV_DISPATCH_META(meta, "rkv.append", meta_t, [&] {
        const fp_t* x = fresh.const_data_ptr<fp_t>();
        at::parallel_for(0, g.batch * g.kv_heads, 1, [&](int64_t begin, int64_t end) {
          BlockScratch scratch(block_tokens, g.dim / group, g.dim);
          OutlierScratch o_scratch(g.block, g.dim, side.outliers != nullptr);
          RefineScratch r_scratch(side, g.dim);
          for (int64_t bh = begin; bh < end; ++bh) {
            const int64_t b = bh / g.kv_heads, h = bh % g.kv_heads, m = count(b);
            if (m > 0) append_one<fp_t, meta_t>(g, pt, side, x, a.rows, clip, b, h, n[b], m, scratch, o_scratch,
                                                 r_scratch);
          }
        });
      });
    });
  };
  append_side(a.cache.k, a.cache.k_meta, a.k_new, a.k_clip, g.k_block_tokens, g.k_group);
  append_side(a.cache.v, a.cache.v_meta, a.v_new, a.v_clip, g.v_block_tokens, g.v_group);
  if (a.page_fill != nullptr) {  // the quantized rows of every page a completed block landed in
    for (int64_t b = 0; b < g.batch; ++b)
      for (int64_t first = n[b] / g.block * g.block; first + g.block <= n[b] + count(b); first += g.block)
        a.page_fill[pt.page(b, first)] = static_cast<int32_t>(first % g.page_size + g.block);
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) {
  m.impl("cache_append", &cache_append_op<run_append>);
  m.impl("paged_append", &paged_append_op<run_append>);
}

}  // namespace rkv::cpu
