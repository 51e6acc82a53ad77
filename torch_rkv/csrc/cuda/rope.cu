// CUDA kernel of rkv::rope: one thread per (row, pair) plus the pass-through channels.
#include "common.cuh"
#include "rkv/rope.h"

namespace rkv::cuda {
namespace {

template <typename scalar_t>
__global__ void rope_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out, const float* __restrict__ cos,
                            const float* __restrict__ sin, const int64_t* __restrict__ pos, int64_t rows, int64_t dim,
                            int64_t half, int64_t table, bool interleaved, bool inverse) {
  const int64_t per_row = dim - half;  // half pairs + (dim - 2*half) pass-through channels
  const int64_t n = rows * per_row;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / per_row, j = i % per_row;
    const scalar_t* xr = x + r * dim;
    scalar_t* orow = out + r * dim;
    if (j >= half) {
      const int64_t c = 2 * half + (j - half);
      orow[c] = xr[c];
      continue;
    }
    const int64_t p = pos[r];
    CUDA_KERNEL_ASSERT_MSG(p >= 0 && p < table, "rkv.rope: positions outside the cos/sin table");
    int64_t a, b;
    rope_pair_channels(j, half, interleaved, a, b);
    float x0 = static_cast<float>(xr[a]), x1 = static_cast<float>(xr[b]);
    const float c = cos[p * half + j], s = sin[p * half + j];
    if (inverse) {
      rope_undo(x0, x1, c, s);
    } else {
      rope_apply(x0, x1, c, s);
    }
    orow[a] = static_cast<scalar_t>(x0);
    orow[b] = static_cast<scalar_t>(x1);
  }
}

at::Tensor rope_cuda(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                     const at::Tensor& positions, bool interleaved, bool inverse) {
  check_rope(x_in, cos_in, sin_in, positions);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = cos_in.contiguous().to(at::kFloat);
  const at::Tensor sin = sin_in.contiguous().to(at::kFloat);
  const at::Tensor pos = rope_row_positions(x, positions);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t dim = x.size(-1), rows = pos.numel(), half = cos.size(1);
  const int64_t n = rows * (dim - half);
  if (n == 0) return out;
  RKV_DISPATCH_FLOAT(x.scalar_type(), "rkv.rope", scalar_t, [&] {
    rope_kernel<scalar_t><<<grid_for(n), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), cos.const_data_ptr<float>(),
        sin.const_data_ptr<float>(), pos.const_data_ptr<int64_t>(), rows, dim, half, cos.size(0), interleaved,
        inverse);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) { m.impl("rope", &rope_cuda); }

}  // namespace rkv::cuda
