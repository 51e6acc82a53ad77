// CUDA kernels of rkv::pack and rkv::unpack: one thread per output byte / code.
#include "common.cuh"
#include "rkv/pack.h"

namespace rkv::cuda {
namespace {

// Code i of a row, asserting it fits in `bits` (a wider code would silently lose its high bits; the
// CPU kernel raises, a kernel cannot, so it fails loudly like an out-of-range index).
struct CheckedCodes {
  const uint8_t* codes;
  int bits;
  __device__ uint32_t operator()(int64_t i) const {
    const uint32_t c = codes[i];
    CUDA_KERNEL_ASSERT_MSG(c <= code_mask(bits), "rkv.pack: codes must be < 2^bits");
    return c;
  }
};

__global__ void pack_kernel(const uint8_t* __restrict__ codes, uint8_t* __restrict__ out, int64_t rows, int64_t dim,
                            int bits) {
  const int64_t rb = dim * bits / 8, n = rows * rb;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / rb, k = i % rb;
    out[i] = pack_byte_from(CheckedCodes{codes + r * dim, bits}, k, bits);
  }
}

__global__ void unpack_kernel(const uint8_t* __restrict__ packed, uint8_t* __restrict__ out, int64_t rows,
                              int64_t dim, int bits) {
  const int64_t rb = dim * bits / 8, n = rows * dim;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / dim, c = i % dim;
    out[i] = static_cast<uint8_t>(unpack_code(packed + r * rb, c, bits));
  }
}

at::Tensor pack_cuda(const at::Tensor& codes_in, int64_t bits) {
  check_pack(codes_in, bits);
  const c10::cuda::CUDAGuard guard(codes_in.device());
  const at::Tensor codes = codes_in.contiguous();
  const int64_t dim = codes.size(-1), rows = dim == 0 ? 0 : codes.numel() / dim;
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end());
  shape.back() = dim * bits / 8;
  at::Tensor out = at::empty(shape, codes.options());
  if (out.numel() == 0) return out;
  pack_kernel<<<grid_for(out.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      codes.const_data_ptr<uint8_t>(), out.mutable_data_ptr<uint8_t>(), rows, dim, static_cast<int>(bits));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

at::Tensor unpack_cuda(const at::Tensor& packed_in, int64_t bits) {
  check_unpack(packed_in, bits);
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = packed_in.contiguous();
  const int64_t rb = packed.size(-1), dim = rb * 8 / bits, rows = rb == 0 ? 0 : packed.numel() / rb;
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() = dim;
  at::Tensor out = at::empty(shape, packed.options());
  if (out.numel() == 0) return out;
  unpack_kernel<<<grid_for(out.numel()), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      packed.const_data_ptr<uint8_t>(), out.mutable_data_ptr<uint8_t>(), rows, dim, static_cast<int>(bits));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
}

}  // namespace rkv::cuda
