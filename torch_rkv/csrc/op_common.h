// Host-side pieces that the CPU and CUDA implementation of an op share: output allocation and the
// query / output transforms of decode attention. Kernels differ per backend; these do not.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "checks.h"

namespace rkv {

struct QuantizeOutputs {
  at::Tensor packed, scale, zero;  // zero is empty (numel 0) when symmetric
};

// Contiguous outputs of rkv::quantize for x (on x's device).
QuantizeOutputs empty_quantize_outputs(const at::Tensor& x, const QuantGeometry& g, bool symmetric,
                                       at::ScalarType meta_dtype);

// Contiguous output of rkv::dequantize: packed's shape with the code dim.
at::Tensor empty_dequantize_output(const at::Tensor& packed, const QuantGeometry& g, at::ScalarType out_dtype);

// rkv::hadamard through the dispatcher, so each backend reaches its own kernel.
at::Tensor call_hadamard(const at::Tensor& x, const at::Tensor& signs, bool inverse);

// The query as decode attention uses it: fp32, times the softmax scale, rotated into the keys' Hadamard
// space when k_signs is given.
at::Tensor decode_query(const at::Tensor& q, double scale, const std::optional<at::Tensor>& k_signs);

// The fp32 attention output rotated back out of the values' Hadamard space, in `dtype`.
at::Tensor decode_output(const at::Tensor& out, const std::optional<at::Tensor>& v_signs, at::ScalarType dtype);

}  // namespace rkv
