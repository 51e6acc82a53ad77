// Geometry of the ops' operands, filled by the host checks (checks.h) and read by every kernel, CPU and
// CUDA. Plain integers only, so kernels that include no ATen header can take it too.
#pragma once

#include <cstdint>

#include "rkv/macros.h"

namespace rkv {

// How many of the `rows` rows from token `first` on are sinks (tokens below `sinks`): the rows of a block
// or quantizer tile that do not set ranges and are never taken as sparse outliers.
RKV_HD int64_t sink_rows_in(int64_t sinks, int64_t first, int64_t rows) {
  const int64_t left = sinks - first;
  return left <= 0 ? 0 : (left < rows ? left : rows);
}

// Quantized tensor geometry: x has shape (*lead, tokens, dim); one group is a tile of block_tokens
// tokens x group_size channels; codes are packed along dim.
struct QuantGeometry {
  int64_t lead = 1;
  int64_t tokens = 0;
  int64_t dim = 0;
  int64_t block_tokens = 1;
  int64_t group_size = 1;
  int bits = 8;
  int64_t sink_rows = 0;  // leading tokens of each lead slice that do not set group ranges
  RKV_HD int64_t row_bytes() const { return dim * bits / 8; }
  RKV_HD int64_t blocks() const { return tokens / block_tokens; }
  RKV_HD int64_t groups() const { return dim / group_size; }
  // sink rows among the tokens of block row br (over all lead dims)
  RKV_HD int64_t sink_rows_of(int64_t br) const {
    return sink_rows_in(sink_rows, (br % blocks()) * block_tokens, block_tokens);
  }
};

// A quantized cache as the attention and append kernels see it (reference.py, "The quantized KV
// cache"): a pool of pages of page_size rows per kv head, addressed through block tables, and side
// slots of full-precision rows (sinks and the window ring). The contiguous layout is one page of the
// whole capacity per sequence (max_pages 1, page b and slot b).
struct CacheGeometry {
  int64_t batch = 0, q_heads = 0, kv_heads = 0, dim = 0;
  int64_t page_size = 0;   // rows per page (P)
  int64_t pages = 0;       // pages in the pool
  int64_t max_pages = 1;   // pages per sequence: the block tables' width (1 without tables)
  int64_t slots = 0;       // side slots in the pool
  int64_t k_block_tokens = 1, v_block_tokens = 1, k_group = 1, v_group = 1;
  int64_t sinks = 0, window = 0, recent = 0, block = 1;
  int k_bits = 8, v_bits = 8;
  int64_t rope_half = 0, rope_positions = 0;  // rope_half == 0: keys stored post-RoPE
  bool interleaved = false;
  int64_t split_tokens = 0;  // 0: each backend chooses (CPU by the shapes, CUDA by the SM count)
  // a query sees only the newest sliding_window keys (0: all); a contiguous cache with a sliding window
  // is a ring: token t's quantized row is t % page_size, and a sequence may grow past the rows
  int64_t sliding_window = 0;
  bool ring = false;
  float softcap = 0.0f;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  RKV_HD int64_t group_size() const { return q_heads / kv_heads; }
  // tokens a sequence can address (a ring: any number; its rope table bounds it)
  RKV_HD int64_t max_tokens() const { return ring ? (int64_t{1} << 40) : max_pages * page_size; }
};

}  // namespace rkv
