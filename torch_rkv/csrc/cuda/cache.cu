// CUDA kernels of rkv::cache_append (semantics: cpu/cache.cpp, reference.cache_append).
//
// 1. quantize_blocks_kernel: one thread block per (quantizer tile that the append may complete, sequence x
//    kv head, keys|values); tiles outside [Q(n0), Q(n1)) exit at once. Reads old tokens from the window.
// 2. place_tokens_kernel: one thread per element of the new tokens, writing sinks and window slots.
// Stream order puts every read of step 1 before every write of step 2.
#include "../append_side.h"
#include "block_quant.cuh"
#include "rkv/attention.h"

namespace rkv::cuda {
namespace {

template <typename fp_t>
struct SourceRows {  // token t of the tile: from the window ring if it was cached, else from the new tokens
  const fp_t* window;
  const fp_t* fresh;
  int64_t first, n0, sinks, window_len, dim;
  __device__ const fp_t* operator()(int64_t i) const {
    const int64_t t = first + i;
    return t < n0 ? window + window_slot(t, sinks, window_len) * dim : fresh + (t - n0) * dim;
  }
};

struct DestRows {
  uint8_t* base;
  int64_t row_bytes;
  __device__ uint8_t* operator()(int64_t i) const { return base + i * row_bytes; }
};

// The tiles of one (sequence, kv head) that this thread block owns: tile = blockIdx.x + k * gridDim.x.
template <typename fp_t, typename meta_t>
__device__ void quantize_tiles(const DecodeGeometry& g, const AppendSide<fp_t, meta_t>& a, int64_t bh, int64_t n0,
                               int64_t m, int64_t max_tiles) {
  const int64_t d = g.dim, rb = d * a.bits / 8, ng = d / a.group, meta_rows = g.capacity / a.block_tokens;
  const int64_t q0 = quantized_count(n0, g.sinks, g.recent, g.block);
  const int64_t q1 = quantized_count(n0 + m, g.sinks, g.recent, g.block);
  for (int64_t tile = blockIdx.x; tile < max_tiles; tile += gridDim.x) {
    const int64_t s = q0 + tile * a.block_tokens;  // first packed row of this tile
    if (s >= q1) return;  // uniform across the block
    const SourceRows<fp_t> src{a.window + bh * g.window * d, a.fresh + bh * m * d, g.sinks + s, n0, g.sinks,
                               g.window, d};
    meta_t* scale = a.scale + (bh * meta_rows + s / a.block_tokens) * ng;
    meta_t* zero = a.zero ? a.zero + (bh * meta_rows + s / a.block_tokens) * ng : nullptr;
    quantize_block_row<fp_t, meta_t>(src, DestRows{a.packed + (bh * g.capacity + s) * rb, rb}, a.block_tokens, d,
                                     a.group, a.bits, a.zero == nullptr, a.clip, scale, zero);
    __syncthreads();
  }
}

// grid (tiles, sequence x kv head, keys|values); grid.y is capped at 65535, the loop covers the rest.
template <typename fp_t, typename meta_t>
__global__ void quantize_blocks_kernel(DecodeGeometry g, AppendSide<fp_t, meta_t> k, AppendSide<fp_t, meta_t> v,
                                       const int64_t* __restrict__ lengths, int64_t m, int64_t max_tiles) {
  for (int64_t bh = blockIdx.y; bh < g.batch * g.kv_heads; bh += gridDim.y) {
    const int64_t n0 = lengths[bh / g.kv_heads];
    CUDA_KERNEL_ASSERT_MSG(n0 >= 0 && n0 + m <= g.max_tokens(), "rkv.cache_append: appending past the capacity");
    quantize_tiles(g, blockIdx.z == 0 ? k : v, bh, n0, m, max_tiles);
  }
}

template <typename fp_t>
__global__ void place_tokens_kernel(DecodeGeometry g, fp_t* k_window, fp_t* v_window, fp_t* k_sink, fp_t* v_sink,
                                    const fp_t* __restrict__ k_new, const fp_t* __restrict__ v_new,
                                    const int64_t* __restrict__ lengths, int64_t m) {
  const int64_t d = g.dim, total = g.batch * g.kv_heads * m * d;
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = e % d, i = (e / d) % m, bh = e / (d * m), b = bh / g.kv_heads;
    const int64_t n0 = lengths[b], t = n0 + i;
    const int64_t q1 = quantized_count(n0 + m, g.sinks, g.recent, g.block);
    if (t < g.sinks) {
      k_sink[(bh * g.sinks + t) * d + c] = k_new[e];
      v_sink[(bh * g.sinks + t) * d + c] = v_new[e];
    } else if (t >= g.sinks + q1) {
      const int64_t slot = window_slot(t, g.sinks, g.window);
      k_window[(bh * g.window + slot) * d + c] = k_new[e];
      v_window[(bh * g.window + slot) * d + c] = v_new[e];
    }
  }
}

void cache_append_cuda(const at::Tensor& k_packed, const at::Tensor& k_scale, const std::optional<at::Tensor>& k_zero,
                       const at::Tensor& v_packed, const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                       const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                       const at::Tensor& v_sink, const at::Tensor& lengths, const at::Tensor& k_new,
                       const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                       bool k_clip, bool v_clip) {
  const DecodeGeometry g = check_cache_append(k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window,
                                              k_sink, v_sink, lengths, k_new, v_new, k_bits, v_bits, block, recent,
                                              k_clip, v_clip);
  const int64_t m = k_new.size(2);
  if (m == 0 || g.batch == 0) return;
  const c10::cuda::CUDAGuard guard(k_new.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  const at::Tensor kn = k_new.contiguous(), vn = v_new.contiguous();
  RKV_DISPATCH_FLOAT(k_window.scalar_type(), "rkv.cache_append", fp_t, [&] {
    RKV_DISPATCH_FLOAT(k_scale.scalar_type(), "rkv.cache_append", meta_t, [&] {
      // an append of m tokens completes at most m / block + 1 blocks
      const int64_t tiles_k = (m / g.block + 1) * (g.block / g.k_block_tokens);
      const int64_t tiles_v = (m / g.block + 1) * (g.block / g.v_block_tokens);
      const int64_t max_tiles = std::max(tiles_k, tiles_v);
      const dim3 grid(static_cast<unsigned>(std::min<int64_t>(max_tiles, 65535)),
                      static_cast<unsigned>(std::min<int64_t>(g.batch * g.kv_heads, 65535)), 2);
      quantize_blocks_kernel<fp_t, meta_t><<<grid, 128, 0, stream>>>(
          g,
          append_side<fp_t, meta_t>(k_packed, k_scale, k_zero, k_window, k_sink, kn, g.k_block_tokens, g.k_group,
                                    k_bits, k_clip),
          append_side<fp_t, meta_t>(v_packed, v_scale, v_zero, v_window, v_sink, vn, g.v_block_tokens, g.v_group,
                                    v_bits, v_clip),
          len.const_data_ptr<int64_t>(), m, max_tiles);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      place_tokens_kernel<fp_t><<<grid_for(kn.numel()), kThreads, 0, stream>>>(
          g, k_window.mutable_data_ptr<fp_t>(), v_window.mutable_data_ptr<fp_t>(), k_sink.mutable_data_ptr<fp_t>(),
          v_sink.mutable_data_ptr<fp_t>(), kn.const_data_ptr<fp_t>(), vn.const_data_ptr<fp_t>(),
          len.const_data_ptr<int64_t>(), m);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) { m.impl("cache_append", &cache_append_cuda); }

}  // namespace rkv::cuda
