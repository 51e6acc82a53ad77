// Shared CUDA plumbing: launch sizing, warp reductions. Kernels run on the current stream under a
// device guard and check every launch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "../dispatch.h"

namespace rkv::cuda {

constexpr int kThreads = 256;

// Grid for a grid-stride loop over n items; capped, the loops cover the rest.
inline unsigned int grid_for(int64_t n, int threads = kThreads) {
  return static_cast<unsigned int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65536)));
}

__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_min(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

}  // namespace rkv::cuda
