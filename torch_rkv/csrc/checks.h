// Argument checks and shapes shared by the CPU and CUDA kernels (host code only).
//
// Every message starts with "rkv.<op>:" and names the argument at fault. The Python fake kernels in
// torch_rkv/ops/ raise the same messages when an op is traced instead of run.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <optional>

#include <vector>

#include "rkv/geometry.h"
#include "rkv/paging.h"

#define RKV_CHECK_VALUE(cond, op, ...) TORCH_CHECK_VALUE(cond, "rkv." op ": ", __VA_ARGS__)
#define RKV_CHECK_TYPE(cond, op, ...) TORCH_CHECK_TYPE(cond, "rkv." op ": ", __VA_ARGS__)

namespace rkv {

void check_bits(const char* op, const char* arg, int64_t bits);
void check_float_input(const char* op, const char* arg, const at::Tensor& t);
void check_float_dtype(const char* op, const char* arg, at::ScalarType dtype);
void check_meta_dtype(const char* op, const char* arg, at::ScalarType dtype);
void check_same_device(const char* op, const at::Tensor& ref, const char* arg, const at::Tensor& t);
void check_row_packable(const char* op, const char* arg, int64_t dim, int64_t bits);

QuantGeometry check_quantize(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t block_tokens,
                             bool symmetric, at::ScalarType meta_dtype, bool clip, int64_t sink_rows = 0);
QuantGeometry check_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero, int64_t bits, at::ScalarType out_dtype);
void check_pack(const at::Tensor& codes, int64_t bits);
void check_unpack(const at::Tensor& packed, int64_t bits);
void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions);
void check_hadamard(const at::Tensor& x, const std::optional<at::Tensor>& signs);

// A side's non-uniform levels (include/rkv/quant.h): float32 (2^bits,) on ref's device, for asymmetric
// codes only; on CPU also finite, strictly ascending and within [0, 2^bits - 1] (on CUDA the values are
// not read back: no sync per call). Returns them contiguous, or an undefined tensor (uniform).
at::Tensor check_levels(const char* op, const char* arg, const at::Tensor& ref, const std::optional<at::Tensor>& levels,
                        int64_t bits, bool symmetric);
// What the kernels take of check_levels' result: its values, or nullptr (uniform).
inline const float* levels_data(const at::Tensor& levels) {
  return levels.defined() ? levels.const_data_ptr<float>() : nullptr;
}

// A side's sparse-outlier buffer (include/rkv/outliers.h): int32 (pages, kv_heads, rows / block, K >= 1),
// contiguous within each page, on ref's device, with block * head_dim <= 65535 (positions fit 16 bits).
// `codes` is the side's codes tensor (pages and rows are read off it). None: no outliers.
void check_outliers(const char* op, const char* arg, const at::Tensor& ref, const std::optional<at::Tensor>& outliers,
                    const at::Tensor& codes, const CacheGeometry& g);

// Refined key channels (reference.refined_rows): k_refine uint8 (pages, kv_heads, rows, m * extra / 8),
// contiguous within each page, and k_channels int32 (kv_heads, m) of distinct channels below head_dim
// (their values are checked on CPU tensors), with extra in 2..4; the keys must be asymmetric per-channel
// uniform codes (k_zero, group 1, no levels, no outliers). Both None: none. Returns k_channels contiguous,
// or an undefined tensor.
at::Tensor check_refine(const char* op, const at::Tensor& ref, const std::optional<at::Tensor>& refine,
                        const std::optional<at::Tensor>& channels, const at::Tensor& codes, bool asymmetric,
                        bool uniform, bool outliers, const CacheGeometry& g);

// The ten tensors of one layer's quantized cache (reference.py, "The quantized KV cache").
struct CacheTensors {
  const at::Tensor& k_codes;
  const at::Tensor& k_scale;
  const std::optional<at::Tensor>& k_zero;
  const at::Tensor& v_codes;
  const at::Tensor& v_scale;
  const std::optional<at::Tensor>& v_zero;
  const at::Tensor& k_window;
  const at::Tensor& v_window;
  const at::Tensor& k_sink;
  const at::Tensor& v_sink;
  const std::optional<at::Tensor>* k_levels = nullptr;  // non-uniform levels of each side (nullptr or None:
  const std::optional<at::Tensor>* v_levels = nullptr;  // uniform codes)
  const std::optional<at::Tensor>* k_outliers = nullptr;  // sparse outliers of each side (nullptr or None:
  const std::optional<at::Tensor>* v_outliers = nullptr;  // none)
  const std::optional<at::Tensor>* k_refine = nullptr;    // refined key channels: their codes and which
  const std::optional<at::Tensor>* k_channels = nullptr;  // channels (nullptr or None: none)
};

// How an op addresses the cache: the paged ops pass block tables and side slots (each may be absent:
// sequence b owns page b / slot b) and name their codes k_codes / v_codes; the contiguous ops pass
// neither and name them k_packed / v_packed.
struct CacheIndex {
  const std::optional<at::Tensor>* block_tables = nullptr;
  const std::optional<at::Tensor>* side_slots = nullptr;
  bool paged = false;
  const at::Tensor* tables() const { return block_tables && block_tables->has_value() ? &**block_tables : nullptr; }
  const at::Tensor* slots() const { return side_slots && side_slots->has_value() ? &**side_slots : nullptr; }
};

// Checks the cache tensors, the index and lengths (B,) of one op call and fills the cache fields of g
// (g.batch, g.kv_heads and g.dim must be set). `ref` is the tensor whose device every one must share.
void check_cache(const char* op, const at::Tensor& ref, const CacheTensors& c, const CacheIndex& ix,
                 const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                 CacheGeometry& g);

// sliding_window (>= 0; 0: none) and softcap (finite, >= 0; 0: none) into g. Before check_cache, which
// makes a contiguous cache with a sliding window a ring.
void check_window_and_cap(const char* op, int64_t sliding_window, double softcap, CacheGeometry& g);

// The query-side arguments of the attention ops (q's shape is the op's to check): rope tables, signs,
// split_tokens. Fills the rope fields of g.
void check_attention_extras(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& rope_cos,
                            const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                            const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                            int64_t split_tokens, CacheGeometry& g);

// query_start_loc (B+1,) of `rows` new rows (int32 or int64), and the tensors that hold those rows.
void check_query_start_loc(const char* op, const at::Tensor& ref, const at::Tensor& query_start_loc, int64_t batch);

// Host-side checks of the data (CPU tensors; on CUDA the kernels assert instead): for every sequence b
// with n[b] cached and m[b] new tokens (m == nullptr: none), n + m within its table, every page id it
// addresses and its slot in range, and the rope table long enough.
void check_cache_data(const char* op, const CacheGeometry& g, const PageTable& pt, const int64_t* n, const int64_t* m);

// The lengths (B,) as int64 and the new-token counts of query_start_loc (B+1,), host-side.
std::vector<int64_t> token_counts(const at::Tensor& query_start_loc_long_cpu);

// Rope positions broadcast to x.shape[:-1], flattened to one int64 per row of x.
at::Tensor rope_row_positions(const at::Tensor& x, const at::Tensor& positions);

}  // namespace rkv
