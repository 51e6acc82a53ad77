// Argument checks and shapes shared by the CPU and CUDA kernels (host code only).
//
// Every message starts with "rkv.<op>:" and names the argument at fault. The Python fake kernels in
// torch_rkv/ops/ raise the same messages when an op is traced instead of run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include "rkv/geometry.h"

#define RKV_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, "rkv." op ": ", __VA_ARGS__)
#define RKV_CHECK_TYPE(cond, op, ...) TORCH_CHECK_TYPE(cond, "rkv." op ": ", __VA_ARGS__)

namespace rkv {

void check_bits(const char* op, const char* arg, int64_t bits);
void check_float_input(const char* op, const char* arg, const at::Tensor& t);
void check_meta_dtype(const char* op, const char* arg, at::ScalarType dtype);
void check_same_device(const char* op, const at::Tensor& ref, const char* arg, const at::Tensor& t);
void check_row_packable(const char* op, const char* arg, int64_t dim, int64_t bits);

QuantGeometry check_quantize(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t block_tokens,
                             bool symmetric, at::ScalarType meta_dtype, bool clip);
QuantGeometry check_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero, int64_t bits, at::ScalarType out_dtype);
void check_pack(const at::Tensor& codes, int64_t bits);
void check_unpack(const at::Tensor& packed, int64_t bits);
void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions);
void check_hadamard(const at::Tensor& x, const std::optional<at::Tensor>& signs);

DecodeGeometry check_decode_attention(
    const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
    const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed, const at::Tensor& v_scale,
    const std::optional<at::Tensor>& v_zero, const at::Tensor& k_window, const at::Tensor& v_window,
    const at::Tensor& k_sink, const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
    int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
    bool rope_interleaved, const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
    int64_t split_tokens);

// The cache buffers shared by decode_attention and cache_append (fills the cache fields of g; g.batch,
// g.kv_heads and g.dim must be set). `ref` is the tensor whose device every buffer must share.
void check_cache_layout(const char* op, const at::Tensor& ref, const at::Tensor& k_packed, const at::Tensor& k_scale,
                        const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                        const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                        const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                        const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                        int64_t block, int64_t recent, DecodeGeometry& g);

DecodeGeometry check_cache_append(const at::Tensor& k_packed, const at::Tensor& k_scale,
                                  const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                                  const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                                  const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                                  const at::Tensor& v_sink, const at::Tensor& lengths, const at::Tensor& k_new,
                                  const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block,
                                  int64_t recent, bool k_clip, bool v_clip);

// Every sequence can take `tokens` more (CPU lengths only; the CUDA kernel asserts).
void check_append_lengths(const DecodeGeometry& g, const at::Tensor& lengths_long_cpu, int64_t tokens);

// Host-side check of lengths against the capacity and the rope table (CPU tensors only: reading a
// CUDA tensor here would synchronize; the CUDA kernel asserts instead).
void check_decode_lengths(const DecodeGeometry& g, const at::Tensor& lengths_long_cpu);

// Rope positions broadcast to x.shape[:-1], flattened to one int64 per row of x.
at::Tensor rope_row_positions(const at::Tensor& x, const at::Tensor& positions);

}  // namespace rkv
