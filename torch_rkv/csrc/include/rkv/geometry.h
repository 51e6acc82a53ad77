// Geometry of the ops' operands, filled by the host checks (checks.h) and read by every kernel, CPU and
// CUDA. Plain integers only, so kernels that include no ATen header can take it too.
#pragma once

#include <cstdint>

#include "rkv/macros.h"

namespace rkv {

// Quantized tensor geometry: x has shape (*lead, tokens, dim); one group is a tile of block_tokens
// tokens x group_size channels; codes are packed along dim.
struct QuantGeometry {
  int64_t lead = 1;
  int64_t tokens = 0;
  int64_t dim = 0;
  int64_t block_tokens = 1;
  int64_t group_size = 1;
  int bits = 8;
  RKV_HD int64_t row_bytes() const { return dim * bits / 8; }
  RKV_HD int64_t blocks() const { return tokens / block_tokens; }
  RKV_HD int64_t groups() const { return dim / group_size; }
};

// Decode attention over the quantized cache layout (reference.decode_attention).
struct DecodeGeometry {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, dim = 0;
  int64_t capacity = 0;            // packed token rows per sequence and head
  int64_t k_block_tokens = 1, v_block_tokens = 1, k_group = 1, v_group = 1;
  int64_t sinks = 0, window = 0, recent = 0, block = 1;
  int k_bits = 8, v_bits = 8;
  int64_t rope_half = 0, rope_positions = 0;  // rope_half == 0: keys stored post-RoPE
  bool interleaved = false;
  int64_t split_tokens = 0;  // 0: each backend chooses (CPU by the shapes, CUDA by the SM count)
  RKV_HD int64_t group_size() const { return q_heads / kv_heads; }
  RKV_HD int64_t max_tokens() const { return sinks + capacity + recent; }
};

}  // namespace rkv
