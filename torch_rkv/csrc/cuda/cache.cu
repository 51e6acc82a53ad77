// CUDA kernels of rkv::cache_append and rkv::paged_append (semantics: cpu/cache.cpp, reference.paged_append).
//
// 1. quantize_blocks_kernel: one thread block per (quantizer tile that the append may complete, sequence x
//    kv head, keys|values); tiles outside the completed blocks exit at once. Reads old tokens from the
//    sinks and the window ring, writes the tile into its page rows.
// 2. place_tokens_kernel: one thread per element of the new tokens, writing sinks and window slots (and
//    asserting what the CPU checks on the host: capacity, page ids, immutable rows, slot_mapping).
// 3. page_fill_kernel: one thread per sequence, advancing the quantized-row count of its pages.
// Stream order puts every read of step 1 before every write of step 2.
#include "../cache_call.h"
#include "../cache_ops.h"
#include "block_quant.cuh"
#include "rkv/attention.h"
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

// The tiles of one (sequence, kv head, side) that this thread block owns: tile = blockIdx.x + k * gridDim.x.
template <typename fp_t, typename meta_t>
__device__ void quantize_tiles(const AppendArgs<fp_t>& a, const SideView& side, const fp_t* fresh, bool clip,
                               int64_t b, int64_t h, int64_t max_tiles) {
  const CacheGeometry& g = a.g;
  const int64_t n0 = a.lengths[b], n1 = n0 + a.count(b), T = side.block_tokens;
  const int64_t first_block = n0 / g.block * g.block, last = n1 / g.block * g.block;  // completed: [first, last)
  const int64_t slot = a.pt.slot(b);
  for (int64_t tile = blockIdx.x; tile < max_tiles; tile += gridDim.x) {
    const int64_t s = first_block + tile * T;  // first token of this tile
    if (s >= last) return;  // uniform across the block
    const int64_t page = a.pt.page(b, s), row = s % g.page_size;
    CUDA_KERNEL_ASSERT_MSG(page >= 0 && page < g.pages, "rkv.paged_append: a block table names a page outside the pool");
    const SourceRows<fp_t> src{&g, static_cast<const fp_t*>(side.sink), static_cast<const fp_t*>(side.window), fresh,
                               a.rows, b, h, slot, s, n0};
    const int64_t meta = side.meta_offset(g, page, h, row);
    meta_t* scale = static_cast<meta_t*>(side.scale) + meta;
    meta_t* zero = side.zero ? static_cast<meta_t*>(side.zero) + meta : nullptr;
    const int64_t sinks_here = g.sinks - s <= 0 ? 0 : (g.sinks - s < T ? g.sinks - s : T);
    quantize_block_row<fp_t, meta_t>(src, DestRows{side.codes + side.codes_offset(g, page, h, row), side.row_bytes(g)},
                                     T, g.dim, side.group, side.bits, zero == nullptr, clip, scale, zero, sinks_here,
                                     side.levels);
    __syncthreads();
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
      // are among the new rows)
      const int64_t most = call.q_start.defined() ? call.k_new.size(0) : call.tokens;
      const int64_t tiles_k = (most / g.block + 1) * (g.block / g.k_block_tokens);
      const int64_t tiles_v = (most / g.block + 1) * (g.block / g.v_block_tokens);
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
