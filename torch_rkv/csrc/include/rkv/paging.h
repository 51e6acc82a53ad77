// Cache addressing shared by every kernel, CPU and CUDA: which page holds a sequence's token, which side
// slot holds its full-precision rows, and where a new token's row is in the caller's tensor.
//
// The paged ops pass block tables and side slots; the contiguous ops pass neither, and sequence b owns
// page b (of the whole capacity) and slot b, so both layouts run the same kernels.
#pragma once

#include <cstdint>

#include "rkv/geometry.h"
#include "rkv/macros.h"

namespace rkv {

struct PageTable {
  const int32_t* tables = nullptr;  // (batch, max_pages) page ids, or nullptr: sequence b owns page b
  const int32_t* slots = nullptr;   // (batch,) side slots, or nullptr: sequence b owns slot b
  int64_t max_pages = 1, page_size = 1;
  RKV_HD int64_t page(int64_t b, int64_t t) const {
    return tables != nullptr ? tables[b * max_pages + t / page_size] : b;
  }
  RKV_HD int64_t slot(int64_t b) const { return slots != nullptr ? slots[b] : b; }
};

// The page that holds a sequence's tokens, remembered: a kernel that walks tokens in order reads the
// block table and divides once per page and compares once per token (the CPU's row reader, the CUDA
// attention's warps).
struct PageCursor {
  int64_t lo = 0, hi = 0;  // tokens [lo, hi) live in `page`, from its row 0
  int64_t page = 0;
  // Points the cursor at token t's page; true when it moved (the caller refreshes what it derived).
  RKV_HD bool seek(const PageTable& pt, int64_t b, int64_t t) {
    if (t >= lo && t < hi) return false;
    page = pt.page(b, t);
    lo = t - t % pt.page_size;
    hi = lo + pt.page_size;
    return true;
  }
  RKV_HD int64_t row(int64_t t) const { return t - lo; }  // token t's row in the page
};

// New tokens (keys or values, or queries) of every sequence in the caller's layout: element offset of
// row i of head h of sequence b. Varlen (T, H, D) with query_start_loc: starts[b] is sequence b's first
// row; the contiguous (B, H, m, D): starts == nullptr and seq_stride apart.
struct FreshRows {
  const int64_t* starts = nullptr;
  int64_t row_stride = 0, head_stride = 0, seq_stride = 0;
  RKV_HD int64_t offset(int64_t b, int64_t h, int64_t i) const {
    return (starts != nullptr ? starts[b] * row_stride : b * seq_stride) + h * head_stride + i * row_stride;
  }
};

// Refined key channels a kv head may have (the CPU decode reads one row's codes into a stack array).
constexpr int64_t kMaxRefined = 256;

// One layer's keys or values: codes and metadata in pages (pages, H, P, D*bits/8) and (pages, H, P/T, D/G)
// whose rows are contiguous but whose pages may be any stride apart (views into one page buffer), and
// full-precision side rows (slots, H, W, D) and (slots, H, S, D). The kernels read or write through it.
struct SideView {
  uint8_t* codes = nullptr;
  void* scale = nullptr;
  void* zero = nullptr;  // nullptr: symmetric
  void* window = nullptr;
  void* sink = nullptr;
  int64_t codes_page_stride = 0;  // bytes
  int64_t meta_page_stride = 0;   // elements (scale and zero alike)
  int64_t block_tokens = 1, group = 1;
  int bits = 8;
  const float* levels = nullptr;  // non-uniform levels (2^bits code values; include/rkv/quant.h), or nullptr
  // sparse outliers (include/rkv/outliers.h): outlier_count entries per block of g.block rows, laid out
  // (pages, H, P / block, K) with rows contiguous and pages outlier_page_stride entries apart; nullptr: none
  uint32_t* outliers = nullptr;
  int64_t outlier_page_stride = 0, outlier_count = 0;
  // refined key channels (reference.refined_rows): channels[h * refine_count + j] of kv head h, and per row
  // refine_count codes of refine_bits bits packed like codes, laid out (pages, H, P, refine_row_bytes) with
  // rows contiguous and pages refine_page_stride bytes apart; nullptr: none
  uint8_t* refine = nullptr;
  const int32_t* channels = nullptr;
  int64_t refine_page_stride = 0, refine_count = 0;
  int refine_bits = 0;
  RKV_HD int64_t row_bytes(const CacheGeometry& g) const { return g.dim * bits / 8; }
  // byte offset of the codes of row `row` of kv head h in page `page`
  RKV_HD int64_t codes_offset(const CacheGeometry& g, int64_t page, int64_t h, int64_t row) const {
    return page * codes_page_stride + (h * g.page_size + row) * row_bytes(g);
  }
  // element offset of the metadata row (scales / zeros of every group) that row `row` of a page reads;
  // a page has fewer than 2^31 rows (checks.cpp), so a 32-bit division, none for per-token metadata
  RKV_HD int64_t meta_offset(const CacheGeometry& g, int64_t page, int64_t h, int64_t row) const {
    const int64_t m = block_tokens == 1 ? row : static_cast<uint32_t>(row) / static_cast<uint32_t>(block_tokens);
    return page * meta_page_stride + (h * (g.page_size / block_tokens) + m) * (g.dim / group);
  }
  RKV_HD int64_t refine_row_bytes() const { return refine_count * refine_bits / 8; }
  // byte offset of the refinement codes of row `row` of kv head h in page `page`
  RKV_HD int64_t refine_offset(const CacheGeometry& g, int64_t page, int64_t h, int64_t row) const {
    return page * refine_page_stride + (h * g.page_size + row) * refine_row_bytes();
  }
  // entry offset of the outliers of the block that row `row` belongs to
  RKV_HD int64_t outlier_offset(const CacheGeometry& g, int64_t page, int64_t h, int64_t row) const {
    return page * outlier_page_stride + (h * (g.page_size / g.block) + row / g.block) * outlier_count;
  }
};

// element offsets of full-precision rows: token t in side slot `slot`, kv head h
RKV_HD int64_t window_offset(const CacheGeometry& g, int64_t slot, int64_t h, int64_t t) {
  return ((slot * g.kv_heads + h) * g.window + t % g.window) * g.dim;
}
RKV_HD int64_t sink_offset(const CacheGeometry& g, int64_t slot, int64_t h, int64_t t) {
  return ((slot * g.kv_heads + h) * g.sinks + t) * g.dim;
}

}  // namespace rkv
