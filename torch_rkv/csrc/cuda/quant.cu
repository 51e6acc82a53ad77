// CUDA kernels of rkv::quantize and rkv::dequantize.
#include "../op_common.h"
#include "block_quant.cuh"

namespace rkv::cuda {
namespace {

constexpr int64_t kWarpBlockRow = 1024;  // values of a block-row up to which one warp quantizes it

template <typename scalar_t>
struct TokenRows {
  const scalar_t* base;
  int64_t dim;
  __device__ const scalar_t* operator()(int64_t t) const { return base + t * dim; }
};

struct PackedRows {
  uint8_t* base;
  int64_t row_bytes;
  __device__ uint8_t* operator()(int64_t t) const { return base + t * row_bytes; }
};

// Each team (the block, or one warp of it) quantizes block-rows in turn.
template <typename scalar_t, typename meta_t, typename Team>
__global__ void quantize_kernel(const scalar_t* __restrict__ x, uint8_t* __restrict__ packed, meta_t* scale,
                                meta_t* zero, QuantGeometry g, bool symmetric, bool clip, const float* lut) {
  const Team team{};
  const int64_t block_rows = g.lead * g.blocks(), ng = g.groups(), teams = blockDim.x / team.size();
  for (int64_t br = blockIdx.x * teams + threadIdx.x / team.size(); br < block_rows; br += gridDim.x * teams) {
    const int64_t row0 = br * g.block_tokens;
    quantize_block_row<scalar_t, meta_t>(TokenRows<scalar_t>{x + row0 * g.dim, g.dim},
                                         PackedRows{packed + row0 * g.row_bytes(), g.row_bytes()}, g.block_tokens,
                                         g.dim, g.group_size, g.bits, symmetric, clip, scale + br * ng,
                                         symmetric ? nullptr : zero + br * ng, g.sink_rows_of(br), lut, Excluded{},
                                         team);
  }
}

// One warp per token row: the row's parameters are located once, its lanes decode the row's channels.
// Each lead slice holds blocks() x block_tokens rows (checks.cpp), so row r reads block row r / block_tokens.
template <typename out_t, typename meta_t>
__global__ void dequantize_kernel(const uint8_t* __restrict__ packed, const meta_t* __restrict__ scale,
                                  const meta_t* __restrict__ zero, out_t* __restrict__ out, QuantGeometry g,
                                  const float* __restrict__ lut) {
  const int64_t rows = g.lead * g.tokens, rb = g.row_bytes(), ng = g.groups(), warps = blockDim.x / 32;
  for (int64_t r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += gridDim.x * warps) {
    const int64_t meta = r / g.block_tokens * ng;
    const uint8_t* codes = packed + r * rb;
    for (int64_t c = threadIdx.x & 31; c < g.dim; c += 32) {
      const int64_t m = meta + c / g.group_size;
      const QParams p{static_cast<float>(scale[m]), zero ? static_cast<float>(zero[m]) : 0.0f};
      out[r * g.dim + c] = static_cast<out_t>(decode(unpack_code(codes, c, g.bits), p, g.bits, zero == nullptr, lut));
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x_in, int64_t bits, int64_t group_size,
                                                            int64_t block_tokens, bool symmetric,
                                                            at::ScalarType meta_dtype, bool clip, int64_t sink_rows,
                                                            const std::optional<at::Tensor>& levels_in) {
  const QuantGeometry g = check_quantize(x_in, bits, group_size, block_tokens, symmetric, meta_dtype, clip, sink_rows);
  const at::Tensor levels = check_levels("quantize", "levels", x_in, levels_in, bits, symmetric);
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const QuantizeOutputs out = empty_quantize_outputs(x, g, symmetric, meta_dtype);
  const at::Tensor &packed = out.packed, &scale = out.scale, &zero = out.zero;
  const int64_t block_rows = g.lead * g.blocks();
  if (block_rows == 0 || g.dim == 0) return {packed, scale, zero};
  const auto stream = c10::cuda::getCurrentCUDAStream();
  RKV_DISPATCH_FLOAT(x.scalar_type(), "rkv.quantize", scalar_t, [&] {
    RKV_DISPATCH_FLOAT(meta_dtype, "rkv.quantize", meta_t, [&] {
      const auto launch = [&](auto kernel, int64_t teams_per_block) {
        kernel<<<grid_for(block_rows, teams_per_block), 128, 0, stream>>>(
            x.const_data_ptr<scalar_t>(), packed.mutable_data_ptr<uint8_t>(), scale.mutable_data_ptr<meta_t>(),
            symmetric ? nullptr : zero.mutable_data_ptr<meta_t>(), g, symmetric, clip, levels_data(levels));
      };
      // A block-row of up to 32 values a lane (per-token groups, short per-channel blocks) is one warp's
      // work; a block-wide team would leave three of its four warps idle while one finds a group's range.
      if (g.block_tokens * g.dim <= kWarpBlockRow)
        launch(quantize_kernel<scalar_t, meta_t, WarpTeam>, 128 / 32);
      else
        launch(quantize_kernel<scalar_t, meta_t, BlockTeam>, 1);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {packed, scale, zero};
}

at::Tensor dequantize_cuda(const at::Tensor& packed_in, const at::Tensor& scale_in,
                           const std::optional<at::Tensor>& zero_in, int64_t bits, at::ScalarType out_dtype,
                           const std::optional<at::Tensor>& levels_in) {
  const QuantGeometry g = check_dequantize(packed_in, scale_in, zero_in, bits, out_dtype);
  const at::Tensor levels = check_levels("dequantize", "levels", packed_in, levels_in, bits, !zero_in.has_value());
  const c10::cuda::CUDAGuard guard(packed_in.device());
  const at::Tensor packed = packed_in.contiguous();
  const at::Tensor scale = scale_in.contiguous();
  const at::Tensor zero = zero_in.has_value() ? zero_in->contiguous() : at::Tensor();
  at::Tensor out = empty_dequantize_output(packed, g, out_dtype);
  const int64_t rows = g.lead * g.tokens;
  if (rows == 0 || g.dim == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  RKV_DISPATCH_FLOAT(out_dtype, "rkv.dequantize", out_t, [&] {
    RKV_DISPATCH_FLOAT(scale.scalar_type(), "rkv.dequantize", meta_t, [&] {
      dequantize_kernel<out_t, meta_t><<<grid_for(rows, kThreads / 32), kThreads, 0, stream>>>(
          packed.const_data_ptr<uint8_t>(), scale.const_data_ptr<meta_t>(),
          zero.defined() ? zero.const_data_ptr<meta_t>() : nullptr, out.mutable_data_ptr<out_t>(), g,
          levels_data(levels));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) {
  m.impl("quantize", &quantize_cuda);
  m.impl("dequantize", &dequantize_cuda);
}

}  // namespace rkv::cuda
