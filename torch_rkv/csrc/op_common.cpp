#include "op_common.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/core/dispatch/Dispatcher.h>

namespace rkv {

QuantizeOutputs empty_quantize_outputs(const at::Tensor& x, const QuantGeometry& g, bool symmetric,
                                       at::ScalarType meta_dtype) {
  std::vector<int64_t> packed_shape(x.sizes().begin(), x.sizes().end());
  packed_shape.back() = g.row_bytes();
  std::vector<int64_t> meta(x.sizes().begin(), x.sizes().end());
  meta[meta.size() - 2] = g.blocks();
  meta[meta.size() - 1] = g.groups();
  const auto opts = x.options().dtype(meta_dtype);
  return {at::empty(packed_shape, x.options().dtype(at::kByte)), at::empty(meta, opts),
          symmetric ? at::empty({0}, opts) : at::empty(meta, opts)};
}

at::Tensor empty_dequantize_output(const at::Tensor& packed, const QuantGeometry& g, at::ScalarType out_dtype) {
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() = g.dim;
  return at::empty(shape, packed.options().dtype(out_dtype));
}

at::Tensor call_hadamard(const at::Tensor& x, const at::Tensor& signs, bool inverse) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("rkv::hadamard", "")
                       .typed<at::Tensor(const at::Tensor&, const std::optional<at::Tensor>&, bool)>();
  return op.call(x, signs, inverse);
}

at::Tensor decode_query(const at::Tensor& q, double scale, const std::optional<at::Tensor>& k_signs) {
  at::Tensor qf = q.to(at::kFloat).mul(scale).contiguous();
  return k_signs.has_value() ? call_hadamard(qf, *k_signs, false) : qf;
}

at::Tensor decode_output(const at::Tensor& out, const std::optional<at::Tensor>& v_signs, at::ScalarType dtype) {
  return (v_signs.has_value() ? call_hadamard(out, *v_signs, true) : out).to(dtype);
}

}  // namespace rkv
