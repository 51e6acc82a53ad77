// CUDA kernel of rkv::hadamard: one thread block per row, butterflies in shared memory, stage by stage
// in the order of include/rkv/hadamard.h.
#include "common.cuh"
#include "rkv/hadamard.h"

namespace rkv::cuda {
namespace {

template <typename scalar_t>
__global__ void hadamard_kernel(const scalar_t* __restrict__ x, scalar_t* __restrict__ out,
                                const float* __restrict__ signs, int64_t rows, int64_t dim, bool inverse) {
  extern __shared__ float v[];
  const int64_t n = hadamard_block(dim);
  const float norm = hadamard_norm(n);
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const scalar_t* xr = x + r * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      const float xv = static_cast<float>(xr[c]);
      v[c] = (signs && !inverse) ? mul_rn(xv, signs[c]) : xv;
    }
    __syncthreads();
    for (int64_t h = 1; h < n; h *= 2) {
      // pair p -> (j, j + h) with j = the p-th index whose bit h is clear within its block
      for (int64_t p = threadIdx.x; p < dim / 2; p += blockDim.x) {
        const int64_t j = (p / h) * 2 * h + (p % h);
        butterfly(v[j], v[j + h]);
      }
      __syncthreads();
    }
    scalar_t* orow = out + r * dim;
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      const float y = mul_rn(v[c], norm);
      orow[c] = static_cast<scalar_t>((signs && inverse) ? mul_rn(y, signs[c]) : y);
    }
    __syncthreads();  // v is reused by the next row
  }
}

at::Tensor hadamard_cuda(const at::Tensor& x_in, const std::optional<at::Tensor>& signs_in, bool inverse) {
  check_hadamard(x_in, signs_in);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  const at::Tensor signs = signs_in.has_value() ? signs_in->contiguous().to(at::kFloat) : at::Tensor();
  if (rows == 0) return out;
  const int threads = static_cast<int>(std::min<int64_t>(256, std::max<int64_t>(32, dim / 2)));
  const size_t smem = static_cast<size_t>(dim) * sizeof(float);  // dim <= 8192: at most 32 KiB
  RKV_DISPATCH_FLOAT(x.scalar_type(), "rkv.hadamard", scalar_t, [&] {
    hadamard_kernel<scalar_t><<<grid_for(rows, 1), threads, smem, c10::cuda::getCurrentCUDAStream()>>>(
        x.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(),
        signs.defined() ? signs.const_data_ptr<float>() : nullptr, rows, dim, inverse);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) { m.impl("hadamard", &hadamard_cuda); }

}  // namespace rkv::cuda
