// rkv::paged_copy: copy whole pages (with their sparse outliers and refinement codes) and side slots inside one layer's cache, for a fork (prefix sharing,
// beam search): the full pages of the parent are shared by reference, only its open page and its side
// rows are copied. One implementation for both backends, made of ATen's own copy kernels; the checks
// name what is wrong (ids out of range, a destination given twice).
#include <ATen/core/Tensor.h>
#include <ATen/ops/index_select.h>
#include <torch/library.h>

#include <unordered_set>

#include "checks.h"

namespace rkv {
namespace {

void check_ids(const at::Tensor& ref, const char* src_name, const at::Tensor& src, const char* dst_name,
               const at::Tensor& dst, int64_t limit, const char* what) {
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor&>{src_name, src}, {dst_name, dst}}) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, "rkv.paged_copy: ", name,
                     " must be int32 or int64 (got ", t.scalar_type(), ")");
    TORCH_CHECK_VALUE(t.dim() == 1, "rkv.paged_copy: ", name, " must be 1-D, got ", t.sizes());
    check_same_device("paged_copy", ref, name, t);
  }
  TORCH_CHECK_VALUE(src.size(0) == dst.size(0), "rkv.paged_copy: ", src_name, " and ", dst_name,
                    " must have the same length, got ", src.size(0), " and ", dst.size(0));
  if (!src.is_cpu()) return;  // CUDA: index_select asserts on the device, no host sync
  const at::Tensor s = src.to(at::kLong).contiguous(), d = dst.to(at::kLong).contiguous();
  std::unordered_set<int64_t> seen;
  for (int64_t i = 0; i < s.size(0); ++i) {
    const int64_t a = s.const_data_ptr<int64_t>()[i], b = d.const_data_ptr<int64_t>()[i];
    TORCH_CHECK_VALUE(a >= 0 && a < limit && b >= 0 && b < limit, "rkv.paged_copy: ", src_name, "[", i, "] = ", a,
                      " or ", dst_name, "[", i, "] = ", b, " is outside the ", limit, " ", what);
    TORCH_CHECK_VALUE(seen.insert(b).second, "rkv.paged_copy: ", dst_name, " names ", what, " ", b, " twice");
  }
}

void copy_rows(const at::Tensor& t, const at::Tensor& src, const at::Tensor& dst) {
  if (src.size(0) == 0) return;
  const at::Tensor s = src.to(t.device(), at::kLong), d = dst.to(t.device(), at::kLong);
  t.index_copy_(0, d, at::index_select(t, 0, s));  // the gather first: sources that are also destinations stay right
}

void paged_copy(const at::Tensor& k_codes, const at::Tensor& k_scale, const std::optional<at::Tensor>& k_zero,
                const at::Tensor& v_codes, const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                const at::Tensor& v_sink, const std::optional<at::Tensor>& page_fill, const at::Tensor& src_pages,
                const at::Tensor& dst_pages, const at::Tensor& src_slots, const at::Tensor& dst_slots,
                const std::optional<at::Tensor>& k_outliers, const std::optional<at::Tensor>& v_outliers,
                const std::optional<at::Tensor>& k_refine) {
  const std::pair<const char*, const at::Tensor*> paged[] = {{"k_codes", &k_codes}, {"k_scale", &k_scale},
                                                             {"v_codes", &v_codes}, {"v_scale", &v_scale}};
  const int64_t pages = k_codes.dim() >= 1 ? k_codes.size(0) : 0;
  for (const auto& [name, t] : paged) {
    check_same_device("paged_copy", k_codes, name, *t);
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == pages, "rkv.paged_copy: ", name, " must have shape (pages=",
                      pages, ", kv_heads, rows, ...), got ", t->sizes());
  }
  const int64_t slots = k_window.dim() >= 1 ? k_window.size(0) : 0;
  const std::pair<const char*, const at::Tensor*> side[] = {{"k_window", &k_window}, {"v_window", &v_window},
                                                            {"k_sink", &k_sink}, {"v_sink", &v_sink}};
  for (const auto& [name, t] : side) {
    check_same_device("paged_copy", k_codes, name, *t);
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == slots, "rkv.paged_copy: ", name, " must have shape (slots=",
                      slots, ", kv_heads, rows, head_dim), got ", t->sizes());
  }
  for (const auto& [name, t] : {std::pair<const char*, const std::optional<at::Tensor>*>{"k_outliers", &k_outliers},
                                {"v_outliers", &v_outliers}, {"k_refine", &k_refine}}) {
    if (!t->has_value()) continue;
    const at::ScalarType want = t == &k_refine ? at::kByte : at::kInt;
    TORCH_CHECK_TYPE((*t)->scalar_type() == want, "rkv.paged_copy: ", name, " must be ",
                     want == at::kByte ? "uint8" : "int32", " (got ", (*t)->scalar_type(), ")");
    check_same_device("paged_copy", k_codes, name, **t);
    TORCH_CHECK_VALUE((*t)->dim() == 4 && (*t)->size(0) == pages, "rkv.paged_copy: ", name, " must have shape (pages=",
                      pages, ", kv_heads, ", t == &k_refine ? "rows, bytes" : "blocks, outliers", "), got ",
                      (*t)->sizes());
  }
  if (page_fill.has_value())
    TORCH_CHECK_VALUE(page_fill->dim() == 1 && page_fill->size(0) == pages, "rkv.paged_copy: page_fill must have "
                      "shape (", pages, ",), got ", page_fill->sizes());
  check_ids(k_codes, "src_pages", src_pages, "dst_pages", dst_pages, pages, "pages");
  check_ids(k_codes, "src_slots", src_slots, "dst_slots", dst_slots, slots, "side slots");
  for (const auto& [name, t] : paged) copy_rows(*t, src_pages, dst_pages);
  for (const auto* z : {&k_zero, &v_zero, &k_outliers, &v_outliers, &k_refine})
    if (z->has_value()) copy_rows(**z, src_pages, dst_pages);
  if (page_fill.has_value()) copy_rows(*page_fill, src_pages, dst_pages);
  for (const auto& [name, t] : side) copy_rows(*t, src_slots, dst_slots);
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) { m.impl("paged_copy", &paged_copy); }

}  // namespace rkv
