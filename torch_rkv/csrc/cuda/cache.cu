// CUDA kernels of rkv::cache_append and rkv::paged_append (semantics: cpu/cache.cpp, reference.paged_append).
//
// 1. quantize_blocks_kernel: one thread block per (quantizer tile that the append may complete, sequence x
//    kv head, keys|values); tiles outside the completed blocks exit at once. Reads old tokens from the
//    sinks and the window ring, writes the tile into its page rows. A side with sparse outliers goes a
//    whole block at a time: its outliers are chosen, its tiles quantized without them, their entries written.
// 2. place_tokens_kernel: one thread per element of the new tokens, writing sinks and window slots (and
//    asserting what the CPU checks on the host: capacity, page ids, immutable rows, slot_mapping).
// 3. page_fill_kernel: one thread per sequence, advancing the quantized-row count of its pages.
// Stream order puts every read of step 1 before every write of step 2.
#include "../cache_call.h"
#include "../cache_ops.h"
#include "block_quant.cuh"
#include "rkv/attention.h"
#include "rkv/outliers.h"
#include "rkv/paging.h"

namespace rkv::cuda {
namespace {

// What every kernel of one append reads: the cache, its addressing, and where the new tokens are.
template <typename fp_t>
struct AppendArgs {
  CacheGeometry g;
  PageTable pt;
  SideView k, v;
  const fp_t* k_new;
  const fp_t* v_new;
  FreshRows rows;
  const int64_t* lengths;
  const int64_t* q_start;  // (B+1), or nullptr: every sequence takes `tokens`
  int64_t tokens;
  int32_t* page_fill;       // or nullptr
  const int64_t* slot_mapping;  // or nullptr
  bool k_clip, v_clip;
  __device__ int64_t count(int64_t b) const { return q_start ? q_start[b + 1] - q_start[b] : tokens; }
};

template <typename fp_t>
struct SourceRows {  // token t of the tile: from the sinks or the window ring if it was cached, else new
  const CacheGeometry* g;
  const fp_t* sink;
  const fp_t* window;
  const fp_t* fresh;
  FreshRows rows;
  int64_t b, h, slot, first, n0;
  __device__ const fp_t* operator()(int64_t i) const {
    const int64_t t = first + i;
    if (t >= n0) return fresh + rows.offset(b, h, t - n0);
    return t < g->sinks ? sink + sink_offset(*g, slot, h, t) : window + window_offset(*g, slot, h, t);
  }
};

struct DestRows {
  uint8_t* base;  // row 0 of the tile
  int64_t row_bytes;
  __device__ uint8_t* operator()(int64_t i) const { return base + i * row_bytes; }
};

// One candidate of the outlier selection: the best (gain, key) of some groups and the position it takes
// (key -1: none). Keys are group * 2 + end, below 2 * 65535, so 32 bits hold them.
struct OutlierPick {
  float gain;
  int key, pos;
};

// b into a if it wins by the selection's tie rule (outlier_better), which orders any two picks alike
// whichever is first, so a reduction in any order finds the CPU's choice.
__device__ __forceinline__ void keep_better(OutlierPick& a, const OutlierPick& b) {
  if (outlier_better(b.gain, b.key, a.gain, a.key)) a = b;
}

// The greedy selection of cpu/outliers.h (select_outliers) by the whole thread block: taken (a shared
// bitmask of the block's positions, cleared) gets the chosen positions; returns how many. Each thread
// keeps the best pick of its groups (gi = threadIdx.x + k * blockDim.x), the block reduces them, and only
// the owner of the group that lost a value scans its groups again (the others' extremes did not change).
template <typename Value>
__device__ int64_t select_outliers(const Value& value, int64_t block, const OutlierGroups& og, int64_t count,
                                   uint32_t* taken) {
  __shared__ OutlierPick warp_best[32];
  __shared__ OutlierPick win;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  const auto is_taken = [&](int64_t pos) { return ((taken[pos >> 5] >> (pos & 31)) & 1u) != 0; };
  const int64_t groups = og.groups(block);
  const auto own_best = [&] {
    OutlierPick p{0.0f, -1, -1};
    for (int64_t gi = threadIdx.x; gi < groups; gi += blockDim.x) {
      const Extremes e = og.extremes(gi, value, is_taken);
      for (int side = 0; side < 2; ++side)
        keep_better(p, OutlierPick{e.gain(side == 0), static_cast<int>(2 * gi + side),
                                   static_cast<int>(side == 0 ? e.hi_pos : e.lo_pos)});
    }
    return p;
  };
  OutlierPick mine = own_best();
  int64_t k = 0;
  for (; k < count; ++k) {
    OutlierPick p = mine;
    for (int o = 16; o > 0; o >>= 1)
      keep_better(p, OutlierPick{__shfl_xor_sync(0xffffffffu, p.gain, o), __shfl_xor_sync(0xffffffffu, p.key, o),
                                 __shfl_xor_sync(0xffffffffu, p.pos, o)});
    if (lane == 0) warp_best[warp] = p;
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int w = 1; w < warps; ++w) keep_better(p, warp_best[w]);
      if (p.key >= 0) taken[p.pos >> 5] |= 1u << (p.pos & 31);
      win = p;
    }
    __syncthreads();
    const OutlierPick w = win;
    if (w.key < 0) break;  // no group's range shrinks any more (uniform across the block)
    if ((w.key / 2) % blockDim.x == threadIdx.x) mine = own_best();
  }
  return k;
}

// The block's outlier_count entries (cpu/outliers.h, write_outliers): one per taken position in ascending
// order, the residual against the dense part as stored (codes and metadata read back), then kOutlierEmpty.
// Call after the block's tiles are written and synchronized.
template <typename meta_t, typename Value>
__device__ void write_outliers(const CacheGeometry& g, const SideView& side, const Value& value, int64_t page,
                               int64_t h, int64_t row0, const uint32_t* taken, int64_t n_taken) {
  uint32_t* out = side.outliers + side.outlier_offset(g, page, h, row0);
  if (threadIdx.x == 0) {  // the bitmask walked in order: positions come out sorted
    int64_t i = 0;
    for (int64_t w = 0; w * 32 < g.block * g.dim; ++w)
      for (uint32_t bits = taken[w]; bits != 0; bits &= bits - 1) {
        const int64_t pos = w * 32 + __ffs(bits) - 1;
        out[i++] = outlier_entry(pos, sub_rn(value(pos), dense_value<meta_t>(side, g, page, h, row0, pos)));
      }
  }
  for (int64_t i = n_taken + threadIdx.x; i < side.outlier_count; i += blockDim.x) out[i] = kOutlierEmpty;
}

// The work items of one (sequence, kv head, side) that this thread block owns: item = blockIdx.x + k *
// gridDim.x, each one quantizer tile (T rows), or with sparse outliers one whole block (g.block rows, its
// tiles in turn), since the outliers are chosen over the block.
template <typename fp_t, typename meta_t>
__device__ void quantize_tiles(const AppendArgs<fp_t>& a, const SideView& side, const fp_t* fresh, bool clip,
                               int64_t b, int64_t h, int64_t max_items) {
  const CacheGeometry& g = a.g;
  const int64_t n0 = a.lengths[b], n1 = n0 + a.count(b), T = side.block_tokens;
  const int64_t first_block = n0 / g.block * g.block, last = n1 / g.block * g.block;  // completed: [first, last)
  const int64_t slot = a.pt.slot(b);
  const bool outliers = side.outliers != nullptr;
  const int64_t unit = outliers ? g.block : T;
  __shared__ uint32_t taken[(kOutlierPositions + 31) / 32];  // block * dim <= kOutlierPositions
  for (int64_t item = blockIdx.x; item < max_items; item += gridDim.x) {
    const int64_t first = first_block + item * unit;  // first token of this item
    if (first >= last) return;  // uniform across the block
    const SourceRows<fp_t> block_src{&g, static_cast<const fp_t*>(side.sink), static_cast<const fp_t*>(side.window),
                                     fresh, a.rows, b, h, slot, first, n0};
    const auto value = [&](int64_t pos) { return static_cast<float>(block_src(pos / g.dim)[pos % g.dim]); };
    int64_t n_taken = 0;
    if (outliers) {
      for (int64_t w = threadIdx.x; w * 32 < g.block * g.dim; w += blockDim.x) taken[w] = 0;
      __syncthreads();
      const OutlierGroups og{g.dim, T, side.group, sink_rows_in(g.sinks, first, g.block)};
      n_taken = select_outliers(value, g.block, og, side.outlier_count, taken);
    }
    for (int64_t s = first; s < first + unit; s += T) {
      const int64_t page = a.pt.page(b, s), row = s % g.page_size;
      CUDA_KERNEL_ASSERT_MSG(page >= 0 && page < g.pages, "rkv.paged_append: a block table names a page outside the pool");
      const SourceRows<fp_t> src{&g, static_cast<const fp_t*>(side.sink), static_cast<const fp_t*>(side.window), fresh,
                                 a.rows, b, h, slot, s, n0};
      const int64_t meta = side.meta_offset(g, page, h, row);
      meta_t* scale = static_cast<meta_t*>(side.scale) + meta;
      meta_t* zero = side.zero ? static_cast<meta_t*>(side.zero) + meta : nullptr;
      quantize_block_row<fp_t, meta_t>(src, DestRows{side.codes + side.codes_offset(g, page, h, row), side.row_bytes(g)},
                                       T, g.dim, side.group, side.bits, zero == nullptr, clip, scale, zero,
                                       sink_rows_in(g.sinks, s, T), side.levels,
                                       Excluded{outliers ? taken : nullptr, (s - first) * g.dim});
      __syncthreads();
    }
    if (outliers) {
      write_outliers<meta_t>(g, side, value, a.pt.page(b, first), h, first % g.page_size, taken, n_taken);
      __syncthreads();  // thread 0 reads taken until here; the next item clears it
    }
  }
}

// grid (tiles, sequence x kv head, keys|values); grid.y is capped at 65535, the loop covers the rest.
template <typename fp_t, typename meta_t>
__global__ void quantize_blocks_kernel(AppendArgs<fp_t> a, int64_t max_tiles) {
  for (int64_t bh = blockIdx.y; bh < a.g.batch * a.g.kv_heads; bh += gridDim.y) {
    const int64_t b = bh / a.g.kv_heads, h = bh % a.g.kv_heads;
    const int64_t n0 = a.lengths[b];
    CUDA_KERNEL_ASSERT_MSG(n0 >= 0 && n0 + a.count(b) <= a.g.max_tokens(),
                           "rkv.paged_append: appending past the tokens a sequence's pages address");
    if (blockIdx.z == 0) {
      quantize_tiles<fp_t, meta_t>(a, a.k, a.k_new, a.k_clip, b, h, max_tiles);
    } else {
      quantize_tiles<fp_t, meta_t>(a, a.v, a.v_new, a.v_clip, b, h, max_tiles);
    }
  }
}

// The sequence that owns new-token row r (upper bound in query_start_loc), or -1 for padding rows.
__device__ int64_t owner(const int64_t* q_start, int64_t batch, int64_t r) {
  if (r < q_start[0] || r >= q_start[batch]) return -1;
  int64_t lo = 0, hi = batch;  // q_start[lo] <= r < q_start[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (q_start[mid] <= r) lo = mid; else hi = mid;
  }
  return lo;
}

template <typename fp_t>
__global__ void place_tokens_kernel(AppendArgs<fp_t> a, int64_t new_rows) {
  const CacheGeometry& g = a.g;
  const int64_t d = g.dim, total = new_rows * g.kv_heads * d;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % d, h = (e / d) % g.kv_heads, r = e / (d * g.kv_heads);
    // row r of the new tokens: (sequence b, its token i)
    int64_t b, i;
    if (a.q_start != nullptr) {
      b = owner(a.q_start, g.batch, r);
      if (b < 0) continue;  // padding
      i = r - a.q_start[b];
    } else {
      b = r / a.tokens;
      i = r % a.tokens;
    }
    const int64_t t = a.lengths[b] + i, slot = a.pt.slot(b);
    const int64_t q1 = quantized_count(a.lengths[b] + a.count(b), g.recent, g.block);
    if (c == 0 && h == 0) {
      const int64_t page = a.pt.page(b, t);
      CUDA_KERNEL_ASSERT_MSG(page >= 0 && page < g.pages, "rkv.paged_append: a block table names a page outside the pool");
      CUDA_KERNEL_ASSERT_MSG(slot >= 0 && slot < g.slots, "rkv.paged_append: side_slots names a slot outside the pool");
      CUDA_KERNEL_ASSERT_MSG(a.page_fill == nullptr || a.page_fill[page] <= t % g.page_size,
                             "rkv.paged_append: a write into rows a page already holds (a full page is immutable)");
      CUDA_KERNEL_ASSERT_MSG(a.slot_mapping == nullptr || a.slot_mapping[r] == page * g.page_size + t % g.page_size,
                             "rkv.paged_append: slot_mapping disagrees with the block tables");
    }
    const int64_t src = a.rows.offset(b, h, i) + c;
    if (t < g.sinks) {
      static_cast<fp_t*>(a.k.sink)[sink_offset(g, slot, h, t) + c] = a.k_new[src];
      static_cast<fp_t*>(a.v.sink)[sink_offset(g, slot, h, t) + c] = a.v_new[src];
    } else if (t >= q1) {
      static_cast<fp_t*>(a.k.window)[window_offset(g, slot, h, t) + c] = a.k_new[src];
      static_cast<fp_t*>(a.v.window)[window_offset(g, slot, h, t) + c] = a.v_new[src];
    }
  }
}

template <typename fp_t>
__global__ void page_fill_kernel(AppendArgs<fp_t> a) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < a.g.batch;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t n0 = a.lengths[b], n1 = n0 + a.count(b);
    for (int64_t first = n0 / a.g.block * a.g.block; first + a.g.block <= n1; first += a.g.block)
      a.page_fill[a.pt.page(b, first)] = static_cast<int32_t>(first % a.g.page_size + a.g.block);
  }
}

void run_append(const char*, const AppendCall& call) {
  const c10::cuda::CUDAGuard guard(call.k_new.device());
  const CacheGeometry& g = call.cache.g;
  const int64_t new_rows = call.k_new.size(0) * (call.q_start.defined() ? 1 : call.tokens);
  if (g.batch == 0 || new_rows == 0) return;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  RKV_DISPATCH_FLOAT(call.cache.fp, "rkv.append", fp_t, [&] {
    RKV_DISPATCH_FLOAT(call.cache.meta, "rkv.append", meta_t, [&] {
      AppendArgs<fp_t> a{g, call.cache.pt, call.cache.k, call.cache.v, call.k_new.const_data_ptr<fp_t>(),
                         call.v_new.const_data_ptr<fp_t>(), call.rows, call.cache.lengths.const_data_ptr<int64_t>(),
                         call.q_start.defined() ? call.q_start.const_data_ptr<int64_t>() : nullptr, call.tokens,
                         call.page_fill,
                         call.slot_mapping.defined() ? call.slot_mapping.const_data_ptr<int64_t>() : nullptr,
                         call.k_clip, call.v_clip};
      // one sequence's append completes at most new_tokens / block + 1 blocks (every sequence's tokens
      // are among the new rows); a side's work items are its tiles, or its blocks with sparse outliers
      const int64_t most = call.q_start.defined() ? call.k_new.size(0) : call.tokens, blocks = most / g.block + 1;
      const int64_t tiles_k = a.k.outliers != nullptr ? blocks : blocks * (g.block / g.k_block_tokens);
      const int64_t tiles_v = a.v.outliers != nullptr ? blocks : blocks * (g.block / g.v_block_tokens);
      const int64_t max_tiles = std::max(tiles_k, tiles_v);
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>(max_tiles, 65535)),
                      static_cast<unsigned>(std::min<int64_t>(g.batch * g.kv_heads, 65535)), 2);
      quantize_blocks_kernel<fp_t, meta_t><<<grid, 128, 0, stream>>>(a, max_tiles);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      place_tokens_kernel<fp_t><<<grid_for(new_rows * g.kv_heads * g.dim), kThreads, 0, stream>>>(a, new_rows);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (a.page_fill != nullptr) {
        page_fill_kernel<fp_t><<<grid_for(g.batch), kThreads, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) {
  m.impl("cache_append", &cache_append_op<run_append>);
  m.impl("paged_append", &paged_append_op<run_append>);
}

}  // namespace rkv::cuda
