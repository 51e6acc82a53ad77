// CPU kernels of rkv::quantize and rkv::dequantize.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "../dispatch.h"
#include "../op_common.h"
#include "block_quant.h"

namespace rkv::cpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x_in, int64_t bits, int64_t group_size,
                                                           int64_t block_tokens, bool symmetric,
                                                           at::ScalarType meta_dtype, bool clip, int64_t sink_rows,
                                                           const std::optional<at::Tensor>& levels_in) {
  const QuantGeometry g = check_quantize(x_in, bits, group_size, block_tokens, symmetric, meta_dtype, clip, sink_rows);
  const at::Tensor levels = check_levels("quantize", "levels", x_in, levels_in, bits, symmetric);
  const float* lut = levels_data(levels);
  const at::Tensor x = x_in.contiguous();
  const QuantizeOutputs out = empty_quantize_outputs(x, g, symmetric, meta_dtype);
  const at::Tensor &packed = out.packed, &scale = out.scale, &zero = out.zero;
  const int64_t block_rows = g.lead * g.blocks();
  if (block_rows == 0 || g.dim == 0) return {packed, scale, zero};

  RKV_DISPATCH_FLOAT(x.scalar_type(), "rkv.quantize", scalar_t, [&] {
    RKV_DISPATCH_META(meta_dtype, "rkv.quantize", meta_t, [&] {
      const scalar_t* xp = x.const_data_ptr<scalar_t>();
      uint8_t* pp = packed.mutable_data_ptr<uint8_t>();
      meta_t* sp = scale.mutable_data_ptr<meta_t>();
      meta_t* zp = symmetric ? nullptr : zero.mutable_data_ptr<meta_t>();
      const int64_t rb = g.row_bytes(), ng = g.groups(), T = g.block_tokens;
      at::parallel_for(0, block_rows, 1, [&](int64_t begin, int64_t end) {
        BlockScratch scratch(T, ng, g.dim);
        for (int64_t br = begin; br < end; ++br) {
          const int64_t row0 = br * T;  // first token row of this block, over all lead dims
          quantize_block_row<scalar_t, meta_t>(
              [&](int64_t t) { return xp + (row0 + t) * g.dim; }, [&](int64_t t) { return pp + (row0 + t) * rb; },
              T, g.dim, g.group_size, g.bits, symmetric, clip, sp + br * ng, zp ? zp + br * ng : nullptr, scratch,
              g.sink_rows_of(br), lut);
        }
      });
    });
  });
  return {packed, scale, zero};
}

template <typename out_t, typename meta_t>
void dequantize_kernel(const uint8_t* pp, const meta_t* sp, const meta_t* zp, out_t* op, const QuantGeometry& g,
                       const float* lut) {
  const int64_t block_rows = g.lead * g.blocks(), rb = g.row_bytes(), ng = g.groups(), T = g.block_tokens;
  at::parallel_for(0, block_rows, std::max<int64_t>(1, 64 / T), [&](int64_t begin, int64_t end) {
    BlockScratch scratch(1, ng, g.dim);
    for (int64_t br = begin; br < end; ++br) {
      const int64_t row0 = br * T;
      dequantize_block_row<out_t, meta_t>(pp + row0 * rb, sp + br * ng, zp ? zp + br * ng : nullptr,
                                          [&](int64_t t) { return op + (row0 + t) * g.dim; }, T, g.dim,
                                          g.group_size, g.bits, scratch, lut);
    }
  });
}

at::Tensor dequantize_cpu(const at::Tensor& packed_in, const at::Tensor& scale_in,
                          const std::optional<at::Tensor>& zero_in, int64_t bits, at::ScalarType out_dtype,
                          const std::optional<at::Tensor>& levels_in) {
  const QuantGeometry g = check_dequantize(packed_in, scale_in, zero_in, bits, out_dtype);
  const at::Tensor levels = check_levels("dequantize", "levels", packed_in, levels_in, bits, !zero_in.has_value());
  const at::Tensor packed = packed_in.contiguous();
  const at::Tensor scale = scale_in.contiguous();
  const at::Tensor zero = zero_in.has_value() ? zero_in->contiguous() : at::Tensor();
  at::Tensor out = empty_dequantize_output(packed, g, out_dtype);
  if (g.lead * g.tokens == 0 || g.dim == 0) return out;
  RKV_DISPATCH_FLOAT(out_dtype, "rkv.dequantize", out_t, [&] {
    RKV_DISPATCH_META(scale.scalar_type(), "rkv.dequantize", meta_t, [&] {
      dequantize_kernel<out_t, meta_t>(packed.const_data_ptr<uint8_t>(), scale.const_data_ptr<meta_t>(),
                                       zero.defined() ? zero.const_data_ptr<meta_t>() : nullptr,
                                       out.mutable_data_ptr<out_t>(), g, levels_data(levels));
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) {
  m.impl("quantize", &quantize_cpu);
  m.impl("dequantize", &dequantize_cpu);
}

}  // namespace rkv::cpu
