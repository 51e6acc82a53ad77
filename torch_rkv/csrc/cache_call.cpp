#include "cache_call.h"

#include <ATen/core/Tensor.h>

#include <unordered_map>

#include "op_common.h"

namespace rkv {

namespace {

void* ptr(const at::Tensor& t, bool writable) {
  return writable ? t.mutable_data_ptr() : const_cast<void*>(t.const_data_ptr());
}

SideView side_view(const at::Tensor& codes, const at::Tensor& scale, const std::optional<at::Tensor>& zero,
                   const at::Tensor& window, const at::Tensor& sink, int64_t block_tokens, int64_t group, int bits,
                   bool writable) {
  SideView s;
  s.codes = static_cast<uint8_t*>(ptr(codes, writable));
  s.scale = ptr(scale, writable);
  s.zero = zero.has_value() ? ptr(*zero, writable) : nullptr;
  s.window = ptr(window, writable);
  s.sink = ptr(sink, writable);
  s.codes_page_stride = codes.stride(0);
  s.meta_page_stride = scale.stride(0);
  s.block_tokens = block_tokens;
  s.group = group;
  s.bits = bits;
  return s;
}

// q / k_new / v_new of the varlen ops: (rows, heads, head_dim).
void check_rows(const char* op, const char* name, const at::Tensor& t, int64_t rows, int64_t heads, int64_t dim) {
  TORCH_CHECK_VALUE(t.dim() == 3 && t.size(0) == rows && t.size(1) == heads && t.size(2) == dim, "rkv.", op, ": ",
                    name, " must have shape (", rows, ", ", heads, ", ", dim, ") (tokens, heads, head_dim), got ",
                    t.sizes());
}

void check_new_dtype(const char* op, const at::Tensor& k_new, const at::Tensor& v_new, const at::Tensor& window) {
  check_float_input(op, "k_new", k_new);
  TORCH_CHECK_TYPE(k_new.scalar_type() == window.scalar_type() && v_new.scalar_type() == window.scalar_type(), "rkv.",
                   op, ": k_new and v_new must have the cache's full-precision dtype (k_window: ", window.scalar_type(),
                   "), got ", k_new.scalar_type(), " and ", v_new.scalar_type());
  check_same_device(op, k_new, "v_new", v_new);
}

// kv heads of the cache, read off k_codes / k_packed (checked in full by check_cache).
int64_t cache_kv_heads(const char* op, const CacheTensors& c, const CacheIndex& ix) {
  TORCH_CHECK_VALUE(c.k_codes.dim() == 4, "rkv.", op, ": ", ix.paged ? "k_codes" : "k_packed", " must have shape (",
                    ix.paged ? "pages" : "batch", ", kv_heads, ", ix.paged ? "page_size" : "capacity",
                    ", bytes), got ", c.k_codes.sizes());
  return c.k_codes.size(1);
}

}  // namespace

namespace {

// What both attention calls share: the cache, the query in the keys' space, the rope tables in fp32.
AttentionCall attention_call(const char* op, const at::Tensor& q, const CacheTensors& c, const CacheIndex& ix,
                             const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                             const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
                             const std::optional<at::Tensor>& k_signs, double scale, const CacheGeometry& g) {
  AttentionCall call;
  call.cache = resolve_cache(op, q, c, ix, lengths, k_bits, v_bits, block, recent, g, false);
  call.q = decode_query(q, scale, k_signs);
  if (rope_cos.has_value()) {
    call.cos = rope_cos->to(at::kFloat).contiguous();
    call.sin = rope_sin->to(at::kFloat).contiguous();
  }
  return call;
}

}  // namespace

CacheCall resolve_cache(const char* op, const at::Tensor& ref, const CacheTensors& c, const CacheIndex& ix,
                        const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                        CacheGeometry g, bool writable) {
  check_cache(op, ref, c, ix, lengths, k_bits, v_bits, block, recent, g);
  CacheCall out;
  out.g = g;
  out.lengths = lengths.to(at::kLong).contiguous();
  out.pt.max_pages = g.max_pages;
  out.pt.page_size = g.page_size;
  if (const at::Tensor* t = ix.tables()) {
    out.tables = *t;
    out.pt.tables = t->const_data_ptr<int32_t>();
  }
  if (const at::Tensor* t = ix.slots()) {
    out.slots = *t;
    out.pt.slots = t->const_data_ptr<int32_t>();
  }
  out.fp = c.k_window.scalar_type();
  out.k_meta = c.k_scale.scalar_type();
  out.v_meta = c.v_scale.scalar_type();
  out.k = side_view(c.k_codes, c.k_scale, c.k_zero, c.k_window, c.k_sink, g.k_block_tokens, g.k_group, g.k_bits,
                    writable);
  out.v = side_view(c.v_codes, c.v_scale, c.v_zero, c.v_window, c.v_sink, g.v_block_tokens, g.v_group, g.v_bits,
                    writable);
  const std::optional<at::Tensor> none;
  out.k_levels = check_levels(op, "k_levels", ref, c.k_levels ? *c.k_levels : none, k_bits, !c.k_zero.has_value());
  out.v_levels = check_levels(op, "v_levels", ref, c.v_levels ? *c.v_levels : none, v_bits, !c.v_zero.has_value());
  out.k.levels = levels_data(out.k_levels);
  out.v.levels = levels_data(out.v_levels);
  const auto outliers = [&](const char* arg, const std::optional<at::Tensor>* t, const at::Tensor& codes, SideView& s) {
    if (t == nullptr || !t->has_value()) return;
    check_outliers(op, arg, ref, *t, codes, g);
    s.outliers = static_cast<uint32_t*>(ptr(**t, writable));
    s.outlier_page_stride = (*t)->stride(0);
    s.outlier_count = (*t)->size(3);
  };
  outliers("k_outliers", c.k_outliers, c.k_codes, out.k);
  outliers("v_outliers", c.v_outliers, c.v_codes, out.v);
  const std::optional<at::Tensor>& refine = c.k_refine ? *c.k_refine : none;
  out.k_channels = check_refine(op, ref, refine, c.k_channels ? *c.k_channels : none, c.k_codes, c.k_zero.has_value(),
                                !out.k_levels.defined(), out.k.outliers != nullptr, g);
  if (out.k_channels.defined()) {
    out.k.refine = static_cast<uint8_t*>(ptr(*refine, writable));
    out.k.refine_page_stride = refine->stride(0);
    out.k.refine_count = out.k_channels.size(1);
    out.k.refine_bits = static_cast<int>(refine->size(3) * 8 / out.k.refine_count);
    out.k.channels = out.k_channels.const_data_ptr<int32_t>();
  }
  return out;
}

void attach_sink_logits(const char* op, AttentionCall& call, const std::optional<at::Tensor>& sink_logits) {
  if (!sink_logits.has_value()) return;
  check_float_input(op, "sink_logits", *sink_logits);
  TORCH_CHECK_VALUE(sink_logits->dim() == 1 && sink_logits->size(0) == call.q.size(1), "rkv.", op,
                    ": sink_logits must have shape (q_heads=", call.q.size(1), ",), got ", sink_logits->sizes());
  check_same_device(op, call.q, "sink_logits", *sink_logits);
  call.sink_logits = sink_logits->to(at::kFloat).contiguous();
}

AttentionCall decode_call(const char* op, const at::Tensor& q, const CacheTensors& c, const CacheIndex& ix,
                          const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                          const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
                          bool rope_interleaved, const std::optional<at::Tensor>& k_signs,
                          const std::optional<at::Tensor>& v_signs, double scale, int64_t split_tokens,
                          int64_t sliding_window, double softcap) {
  check_float_input(op, "q", q);
  TORCH_CHECK_VALUE(q.dim() == 3, "rkv.", op, ": q must have shape (batch, q_heads, head_dim), got ", q.sizes());
  CacheGeometry g;
  g.batch = q.size(0);
  g.q_heads = q.size(1);
  g.dim = q.size(2);
  g.kv_heads = cache_kv_heads(op, c, ix);
  TORCH_CHECK_VALUE(g.kv_heads >= 1 && g.q_heads % g.kv_heads == 0, "rkv.", op, ": q has ", g.q_heads,
                    " heads, which is not a multiple of the cache's ", g.kv_heads, " kv heads");
  check_attention_extras(op, q, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, split_tokens, g);
  check_window_and_cap(op, sliding_window, softcap, g);
  return attention_call(op, q, c, ix, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, k_signs, scale, g);
}

AttentionCall prefill_call(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& query_start_loc, int64_t max_query_len, const CacheTensors& c,
                           const CacheIndex& ix, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                           int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
                           const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                           const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                           double scale, int64_t split_tokens, int64_t sliding_window, double softcap) {
  const char* op = "paged_prefill_attention";
  check_float_input(op, "q", q);
  TORCH_CHECK_VALUE(q.dim() == 3, "rkv.", op, ": q must have shape (tokens, q_heads, head_dim), got ", q.sizes());
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1, "rkv.", op,
                    ": query_start_loc must have shape (batch + 1,), got ", query_start_loc.sizes());
  TORCH_CHECK_VALUE(max_query_len >= 0, "rkv.", op, ": max_query_len must be >= 0 (got ", max_query_len, ")");
  CacheGeometry g;
  g.batch = query_start_loc.size(0) - 1;
  g.q_heads = q.size(1);
  g.dim = q.size(2);
  g.kv_heads = cache_kv_heads(op, c, ix);
  TORCH_CHECK_VALUE(g.kv_heads >= 1 && g.q_heads % g.kv_heads == 0, "rkv.", op, ": q has ", g.q_heads,
                    " heads, which is not a multiple of the cache's ", g.kv_heads, " kv heads");
  check_query_start_loc(op, q, query_start_loc, g.batch);
  check_new_dtype(op, k_new, v_new, c.k_window);
  check_rows(op, "k_new", k_new, q.size(0), g.kv_heads, g.dim);
  check_rows(op, "v_new", v_new, q.size(0), g.kv_heads, g.dim);
  check_same_device(op, q, "k_new", k_new);
  check_attention_extras(op, q, rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, split_tokens, g);
  check_window_and_cap(op, sliding_window, softcap, g);
  AttentionCall call =
      attention_call(op, q, c, ix, lengths, k_bits, v_bits, block, recent, rope_cos, rope_sin, k_signs, scale, g);
  call.q_start = query_start_loc.to(at::kLong).contiguous();
  call.k_fresh = k_new.contiguous();
  call.v_fresh = v_new.contiguous();
  call.max_query_len = max_query_len;
  return call;
}

AppendCall contiguous_append_call(const CacheTensors& c, const at::Tensor& lengths, const at::Tensor& k_new,
                                  const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block,
                                  int64_t recent, bool k_clip, bool v_clip, int64_t sliding_window) {
  const char* op = "cache_append";
  TORCH_CHECK_VALUE(!(k_clip && !c.k_zero.has_value()), "rkv.cache_append: k_clip needs asymmetric keys (k_zero)");
  TORCH_CHECK_VALUE(!(v_clip && !c.v_zero.has_value()), "rkv.cache_append: v_clip needs asymmetric values (v_zero)");
  check_float_input(op, "k_new", k_new);
  TORCH_CHECK_VALUE(k_new.dim() == 4, "rkv.cache_append: k_new must have shape (batch, kv_heads, tokens, head_dim), ",
                    "got ", k_new.sizes());
  TORCH_CHECK_VALUE(v_new.sizes() == k_new.sizes(), "rkv.cache_append: v_new must have k_new's shape ",
                    k_new.sizes(), ", got ", v_new.sizes());
  CacheGeometry g;
  g.batch = k_new.size(0);
  g.kv_heads = k_new.size(1);
  g.q_heads = g.kv_heads;
  g.dim = k_new.size(3);
  check_window_and_cap(op, sliding_window, 0.0, g);
  const CacheIndex ix;
  AppendCall a;
  a.cache = resolve_cache(op, k_new, c, ix, lengths, k_bits, v_bits, block, recent, g, true);
  check_new_dtype(op, k_new, v_new, c.k_window);
  // a ring: the blocks one append completes (fewer than tokens + block) must not wrap onto each other
  const int64_t most = a.cache.g.page_size - block + 1;
  TORCH_CHECK_VALUE(!a.cache.g.ring || k_new.size(2) <= most, "rkv.cache_append: a ring of ",
                    a.cache.g.page_size, " packed rows (sliding_window=", sliding_window, ") takes at most ", most,
                    " tokens per append (k_new has ", k_new.size(2), "); append in pieces");
  a.k_new = k_new.contiguous();
  a.v_new = v_new.contiguous();
  a.tokens = k_new.size(2);
  a.rows = FreshRows{nullptr, g.dim, a.tokens * g.dim, g.kv_heads * a.tokens * g.dim};
  a.k_clip = k_clip;
  a.v_clip = v_clip;
  return a;
}

AppendCall paged_append_call(const CacheTensors& c, const std::optional<at::Tensor>& page_fill, const CacheIndex& ix,
                             const at::Tensor& lengths, const at::Tensor& query_start_loc, const at::Tensor& k_new,
                             const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                             bool k_clip, bool v_clip, const std::optional<at::Tensor>& slot_mapping) {
  const char* op = "paged_append";
  TORCH_CHECK_VALUE(!(k_clip && !c.k_zero.has_value()), "rkv.paged_append: k_clip needs asymmetric keys (k_zero)");
  TORCH_CHECK_VALUE(!(v_clip && !c.v_zero.has_value()), "rkv.paged_append: v_clip needs asymmetric values (v_zero)");
  check_float_input(op, "k_new", k_new);
  TORCH_CHECK_VALUE(k_new.dim() == 3, "rkv.paged_append: k_new must have shape (tokens, kv_heads, head_dim), got ",
                    k_new.sizes());
  TORCH_CHECK_VALUE(v_new.sizes() == k_new.sizes(), "rkv.paged_append: v_new must have k_new's shape ", k_new.sizes(),
                    ", got ", v_new.sizes());
  CacheGeometry g;
  g.batch = lengths.dim() == 1 ? lengths.size(0) : 0;
  g.kv_heads = k_new.size(1);
  g.q_heads = g.kv_heads;
  g.dim = k_new.size(2);
  check_query_start_loc(op, k_new, query_start_loc, g.batch);
  AppendCall a;
  a.cache = resolve_cache(op, k_new, c, ix, lengths, k_bits, v_bits, block, recent, g, true);
  check_new_dtype(op, k_new, v_new, c.k_window);
  a.k_new = k_new.contiguous();
  a.v_new = v_new.contiguous();
  a.q_start = query_start_loc.to(at::kLong).contiguous();
  a.rows = FreshRows{a.q_start.const_data_ptr<int64_t>(), g.kv_heads * g.dim, g.dim, 0};
  if (page_fill.has_value()) {
    TORCH_CHECK_TYPE(page_fill->scalar_type() == at::kInt, "rkv.paged_append: page_fill must be int32 (got ",
                     page_fill->scalar_type(), ")");
    TORCH_CHECK_VALUE(page_fill->dim() == 1 && page_fill->size(0) == a.cache.g.pages && page_fill->is_contiguous(),
                      "rkv.paged_append: page_fill must be a contiguous (", a.cache.g.pages, ",) tensor, one count ",
                      "per page, got ", page_fill->sizes());
    check_same_device(op, k_new, "page_fill", *page_fill);
    a.page_fill = page_fill->mutable_data_ptr<int32_t>();
  }
  if (slot_mapping.has_value()) {
    TORCH_CHECK_TYPE(slot_mapping->scalar_type() == at::kLong || slot_mapping->scalar_type() == at::kInt,
                     "rkv.paged_append: slot_mapping must be int32 or int64 (got ", slot_mapping->scalar_type(), ")");
    TORCH_CHECK_VALUE(slot_mapping->dim() == 1 && slot_mapping->size(0) == k_new.size(0),
                      "rkv.paged_append: slot_mapping must have shape (", k_new.size(0), ",), got ",
                      slot_mapping->sizes());
    check_same_device(op, k_new, "slot_mapping", *slot_mapping);
    a.slot_mapping = slot_mapping->to(at::kLong).contiguous();
  }
  a.k_clip = k_clip;
  a.v_clip = v_clip;
  return a;
}

void check_append_data(const char* op, const AppendCall& a) {
  const CacheGeometry& g = a.cache.g;
  const PageTable& pt = a.cache.pt;
  const int64_t* n = a.cache.lengths.const_data_ptr<int64_t>();
  std::vector<int64_t> m(g.batch, a.tokens);
  if (a.q_start.defined()) {
    m = token_counts(a.q_start);
    const int64_t* s = a.q_start.const_data_ptr<int64_t>();
    TORCH_CHECK_VALUE(g.batch == 0 || (s[0] >= 0 && s[g.batch] <= a.k_new.size(0)), "rkv.", op,
                      ": query_start_loc must lie in [0, ", a.k_new.size(0), "] (the rows of k_new)");
  }
  check_cache_data(op, g, pt, n, m.data());
  const int64_t P = g.page_size;
  std::unordered_map<int64_t, int64_t> writer;  // page -> the sequence whose new tokens it holds
  for (int64_t b = 0; b < g.batch; ++b) {
    for (int64_t t = n[b]; t < n[b] + m[b]; ++t) {
      const int64_t page = pt.page(b, t);
      const auto [at, fresh] = writer.emplace(page, b);
      TORCH_CHECK_VALUE(fresh || at->second == b, "rkv.", op, ": page ", page, " receives new tokens of sequences ",
                        at->second, " and ", b, " (a page belongs to one sequence while it fills)");
      if (a.page_fill != nullptr)
        TORCH_CHECK_VALUE(a.page_fill[page] <= t % P, "rkv.", op, ": sequence ", b, " writes row ", t % P, " of page ",
                          page, ", which already holds ", a.page_fill[page],
                          " quantized rows (a full page is immutable)");
      if (a.slot_mapping.defined()) {
        const int64_t i = a.rows.starts[b] + t - n[b], slot = a.slot_mapping.const_data_ptr<int64_t>()[i];
        TORCH_CHECK_VALUE(slot == page * P + t % P, "rkv.", op, ": slot_mapping[", i, "] = ", slot,
                          " but the block table puts that token at slot ", page * P + t % P);
      }
    }
  }
}

}  // namespace rkv
