// The raw view of one cached tensor (keys or values) that both cache_append kernels write through.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace rkv {

template <typename fp_t, typename meta_t>
struct AppendSide {
  uint8_t* packed;    // (B*H, C, row_bytes)
  meta_t* scale;      // (B*H, C/T, D/G)
  meta_t* zero;       // same, or nullptr (symmetric)
  fp_t* window;       // (B*H, W, D)
  fp_t* sink;         // (B*H, S, D)
  const fp_t* fresh;  // (B*H, m, D): the new tokens
  int64_t block_tokens, group;
  int bits;
  bool clip;  // clipped-range search (include/rkv/quant.h)
};

template <typename fp_t, typename meta_t>
AppendSide<fp_t, meta_t> append_side(const at::Tensor& packed, const at::Tensor& scale,
                                     const std::optional<at::Tensor>& zero, const at::Tensor& window,
                                     const at::Tensor& sink, const at::Tensor& fresh, int64_t block_tokens,
                                     int64_t group, int64_t bits, bool clip) {
  return {packed.mutable_data_ptr<uint8_t>(), scale.mutable_data_ptr<meta_t>(),
          zero.has_value() ? zero->mutable_data_ptr<meta_t>() : nullptr, window.mutable_data_ptr<fp_t>(),
          sink.mutable_data_ptr<fp_t>(), fresh.const_data_ptr<fp_t>(), block_tokens, group, static_cast<int>(bits), clip};
}

}  // namespace rkv
