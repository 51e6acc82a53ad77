#include "checks.h"

#include <ATen/core/Tensor.h>

#include "rkv/attention.h"
#include "rkv/hadamard.h"
#include "rkv/pack.h"
#include "rkv/paging.h"

namespace rkv {

namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

bool is_meta_type(at::ScalarType t) { return is_float_type(t) || t == at::kFloat8_e4m3fn; }

// Checked once per op family: the shape of x without its last two dims.
std::vector<int64_t> lead_shape(const at::Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end() - 2);
}

}  // namespace

void check_bits(const char* op, const char* arg, int64_t bits) {
  TORCH_CHECK_VALUE(valid_bits(bits), "rkv.", op, ": ", arg, " must be 2, 3, 4 or 8 (got ", bits, ")");
}

void check_float_dtype(const char* op, const char* arg, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(is_float_type(dtype), "rkv.", op, ": ", arg,
                   " must be float32, float16 or bfloat16 (got ", dtype, ")");
}

void check_float_input(const char* op, const char* arg, const at::Tensor& t) {
  check_float_dtype(op, arg, t.scalar_type());
}

void check_meta_dtype(const char* op, const char* arg, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(is_meta_type(dtype), "rkv.", op, ": ", arg,
                   " must be float32, float16, bfloat16 or float8_e4m3fn (got ", dtype, ")");
}

void check_same_device(const char* op, const at::Tensor& ref, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), "rkv.", op, ": ", arg, " is on ", t.device(),
                    " but the input is on ", ref.device());
}

void check_row_packable(const char* op, const char* arg, int64_t dim, int64_t bits) {
  TORCH_CHECK_VALUE((dim * bits) % 8 == 0, "rkv.", op, ": the last dim of ", arg, " (", dim,
                    ") times bits (", bits, ") must be a multiple of 8 to pack whole bytes");
}

QuantGeometry check_quantize(const at::Tensor& x, int64_t bits, int64_t group_size, int64_t block_tokens,
                             bool symmetric, at::ScalarType meta_dtype, bool clip, int64_t sink_rows) {
  TORCH_CHECK_VALUE(sink_rows >= 0, "rkv.quantize: sink_rows must be >= 0 (got ", sink_rows, ")");
  check_bits("quantize", "bits", bits);
  TORCH_CHECK_VALUE(!(clip && symmetric), "rkv.quantize: clip searches asymmetric ranges; it needs symmetric=False");
  check_float_input("quantize", "x", x);
  check_meta_dtype("quantize", "meta_dtype", meta_dtype);
  TORCH_CHECK_VALUE(x.dim() >= 2, "rkv.quantize: x must have at least 2 dims (..., tokens, dim), got shape ",
                    x.sizes());
  QuantGeometry g;
  g.dim = x.size(-1);
  g.tokens = x.size(-2);
  g.bits = static_cast<int>(bits);
  g.group_size = group_size;
  g.block_tokens = block_tokens;
  check_row_packable("quantize", "x", g.dim, bits);
  TORCH_CHECK_VALUE(group_size >= 1 && g.dim % group_size == 0, "rkv.quantize: group_size (", group_size,
                    ") must be >= 1 and divide the last dim of x (", g.dim, ")");
  TORCH_CHECK_VALUE(block_tokens >= 1 && g.tokens % block_tokens == 0, "rkv.quantize: block_tokens (",
                    block_tokens, ") must be >= 1 and divide the token dim of x (", g.tokens,
                    "); quantize whole blocks and keep the rest in full precision");
  g.lead = 1;
  for (int64_t i = 0; i < x.dim() - 2; ++i) g.lead *= x.size(i);
  g.sink_rows = sink_rows;
  return g;
}

QuantGeometry check_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero, int64_t bits, at::ScalarType out_dtype) {
  check_bits("dequantize", "bits", bits);
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "rkv.dequantize: packed must be uint8 (got ",
                   packed.scalar_type(), ")");
  check_meta_dtype("dequantize", "scale", scale.scalar_type());
  check_float_dtype("dequantize", "out_dtype", out_dtype);
  check_same_device("dequantize", packed, "scale", scale);
  TORCH_CHECK_VALUE(packed.dim() >= 2, "rkv.dequantize: packed must have at least 2 dims, got shape ",
                    packed.sizes());
  TORCH_CHECK_VALUE(scale.dim() == packed.dim(), "rkv.dequantize: scale must have as many dims as packed (",
                    packed.dim(), "), got shape ", scale.sizes());
  TORCH_CHECK_VALUE(lead_shape(scale) == lead_shape(packed),
                    "rkv.dequantize: the leading dims of scale ", scale.sizes(),
                    " must equal those of packed ", packed.sizes());
  QuantGeometry g;
  g.bits = static_cast<int>(bits);
  g.tokens = packed.size(-2);
  TORCH_CHECK_VALUE((packed.size(-1) * 8) % bits == 0, "rkv.dequantize: the last dim of packed (",
                    packed.size(-1), " bytes) does not hold a whole number of ", bits, "-bit codes");
  g.dim = packed.size(-1) * 8 / bits;
  const int64_t nb = scale.size(-2), ng = scale.size(-1);
  TORCH_CHECK_VALUE(ng >= 1 && g.dim % ng == 0, "rkv.dequantize: scale's last dim (", ng,
                    " groups) must divide the code dim (", g.dim, ")");
  TORCH_CHECK_VALUE((nb >= 1 && g.tokens % nb == 0) || (nb == 0 && g.tokens == 0),
                    "rkv.dequantize: scale's token-block dim (", nb, ") must divide the token dim of packed (",
                    g.tokens, ")");
  g.group_size = g.dim / ng;
  g.block_tokens = nb == 0 ? 1 : g.tokens / nb;
  if (zero.has_value()) {
    TORCH_CHECK_TYPE(zero->scalar_type() == scale.scalar_type(), "rkv.dequantize: zero must have scale's dtype (",
                     scale.scalar_type(), "), got ", zero->scalar_type());
    TORCH_CHECK_VALUE(zero->sizes() == scale.sizes(), "rkv.dequantize: zero must have scale's shape ",
                      scale.sizes(), ", got ", zero->sizes());
    check_same_device("dequantize", packed, "zero", *zero);
  }
  g.lead = 1;
  for (int64_t i = 0; i < packed.dim() - 2; ++i) g.lead *= packed.size(i);
  return g;
}

at::Tensor check_levels(const char* op, const char* arg, const at::Tensor& ref, const std::optional<at::Tensor>& levels,
                        int64_t bits, bool symmetric) {
  if (!levels.has_value()) return at::Tensor();
  const at::Tensor& t = *levels;
  TORCH_CHECK_VALUE(!symmetric, "rkv.", op, ": ", arg, " (non-uniform levels) needs asymmetric codes; this side is "
                    "symmetric (no zero)");
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, "rkv.", op, ": ", arg, " must be float32 (got ", t.scalar_type(), ")");
  TORCH_CHECK_VALUE(bits <= 4, "rkv.", op, ": ", arg, ": non-uniform levels are for 2, 3 or 4 bits (got ", bits, ")");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == (int64_t{1} << bits), "rkv.", op, ": ", arg, " must have shape (",
                    int64_t{1} << bits, ",), one value per ", bits, "-bit code, got ", t.sizes());
  check_same_device(op, ref, arg, t);
  const at::Tensor out = t.contiguous();
  if (out.is_cpu()) {
    const float* l = out.const_data_ptr<float>();
    const float top = static_cast<float>((1 << bits) - 1);
    for (int64_t i = 0; i < out.size(0); ++i) {
      TORCH_CHECK_VALUE(l[i] >= 0.0f && l[i] <= top && (i == 0 || l[i] > l[i - 1]), "rkv.", op, ": ", arg,
                        " must be strictly ascending code values within [0, ", top, "] (entry ", i, " is ", l[i], ")");
    }
  }
  return out;
}

void check_pack(const at::Tensor& codes, int64_t bits) {
  check_bits("pack", "bits", bits);
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "rkv.pack: codes must be uint8 (got ", codes.scalar_type(),
                   ")");
  TORCH_CHECK_VALUE(codes.dim() >= 1, "rkv.pack: codes must have at least 1 dim");
  check_row_packable("pack", "codes", codes.size(-1), bits);
}

void check_unpack(const at::Tensor& packed, int64_t bits) {
  check_bits("unpack", "bits", bits);
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "rkv.unpack: packed must be uint8 (got ",
                   packed.scalar_type(), ")");
  TORCH_CHECK_VALUE(packed.dim() >= 1, "rkv.unpack: packed must have at least 1 dim");
  TORCH_CHECK_VALUE((packed.size(-1) * 8) % bits == 0, "rkv.unpack: the last dim of packed (", packed.size(-1),
                    " bytes) does not hold a whole number of ", bits, "-bit codes");
}

void check_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions) {
  check_float_input("rope", "x", x);
  check_float_input("rope", "cos", cos);
  TORCH_CHECK_TYPE(sin.scalar_type() == cos.scalar_type(), "rkv.rope: sin must have cos's dtype (",
                   cos.scalar_type(), "), got ", sin.scalar_type());
  TORCH_CHECK_TYPE(positions.scalar_type() == at::kLong || positions.scalar_type() == at::kInt,
                   "rkv.rope: positions must be int32 or int64 (got ", positions.scalar_type(), ")");
  check_same_device("rope", x, "cos", cos);
  check_same_device("rope", x, "sin", sin);
  check_same_device("rope", x, "positions", positions);
  TORCH_CHECK_VALUE(x.dim() >= 1, "rkv.rope: x must have at least 1 dim");
  TORCH_CHECK_VALUE(cos.dim() == 2, "rkv.rope: cos must have shape (positions, rot_dim / 2), got ", cos.sizes());
  TORCH_CHECK_VALUE(sin.sizes() == cos.sizes(), "rkv.rope: sin must have cos's shape ", cos.sizes(), ", got ",
                    sin.sizes());
  TORCH_CHECK_VALUE(cos.size(1) >= 1 && 2 * cos.size(1) <= x.size(-1), "rkv.rope: cos/sin have ", cos.size(1),
                    " pairs per position, but x's last dim (", x.size(-1), ") holds at most ", x.size(-1) / 2);
  TORCH_CHECK_VALUE(positions.dim() <= x.dim() - 1, "rkv.rope: positions of shape ", positions.sizes(),
                    " must broadcast to x.shape[:-1] = ", x.sizes().slice(0, x.dim() - 1));
  const auto rows = x.sizes().slice(0, x.dim() - 1);
  for (int64_t i = 1; i <= positions.dim(); ++i) {
    const int64_t p = positions.size(-i), r = rows[rows.size() - i];
    TORCH_CHECK_VALUE(p == r || p == 1, "rkv.rope: positions of shape ", positions.sizes(),
                      " must broadcast to x.shape[:-1] = ", rows);
  }
}

at::Tensor rope_row_positions(const at::Tensor& x, const at::Tensor& positions) {
  return positions.to(at::kLong).expand(x.sizes().slice(0, x.dim() - 1)).contiguous().view({-1});
}

void check_hadamard(const at::Tensor& x, const std::optional<at::Tensor>& signs) {
  check_float_input("hadamard", "x", x);
  TORCH_CHECK_VALUE(x.dim() >= 1, "rkv.hadamard: x must have at least 1 dim");
  const int64_t d = x.size(-1);
  TORCH_CHECK_VALUE(d >= 2 && hadamard_block(d) >= 2 && d <= 8192, "rkv.hadamard: the last dim of x (", d,
                    ") must be even and at most 8192 (a power of two is transformed whole, other sizes in "
                    "blocks of their largest power-of-two divisor)");
  if (signs.has_value()) {
    check_float_input("hadamard", "signs", *signs);
    check_same_device("hadamard", x, "signs", *signs);
    TORCH_CHECK_VALUE(signs->dim() == 1 && signs->size(0) == d, "rkv.hadamard: signs must have shape (", d,
                      ",), got ", signs->sizes());
  }
}

namespace {

// Dims 1.. of t are contiguous (its pages may be any stride apart: views into one page buffer).
bool rows_contiguous(const at::Tensor& t) {
  if (t.numel() == 0) return true;  // nothing to address (a cache of capacity 0)
  int64_t expect = 1;
  for (int64_t i = t.dim() - 1; i >= 1; --i) {
    if (t.size(i) != 1 && t.stride(i) != expect) return false;
    expect *= t.size(i);
  }
  return true;
}

// One quantized tensor of the cache: codes (pages, H, P, D*bits/8), scale/zero (pages, H, P/T, D/G).
void check_cache_quantized(const char* op, const char* side, const at::Tensor& ref, const at::Tensor& codes,
                           const at::Tensor& scale, const std::optional<at::Tensor>& zero, int64_t bits,
                           const CacheIndex& ix, CacheGeometry& g, int64_t& block_tokens, int64_t& group) {
  const std::string p = std::string(side) + (ix.paged ? "_codes" : "_packed"), sc = std::string(side) + "_scale",
                    zr = std::string(side) + "_zero";
  const char* pages = ix.paged ? "pages" : "batch";
  check_bits(op, (std::string(side) + "_bits").c_str(), bits);
  TORCH_CHECK_TYPE(codes.scalar_type() == at::kByte, "rkv.", op, ": ", p, " must be uint8 (got ", codes.scalar_type(),
                   ")");
  check_meta_dtype(op, sc.c_str(), scale.scalar_type());
  check_same_device(op, ref, p.c_str(), codes);
  check_same_device(op, ref, sc.c_str(), scale);
  const bool tabled = ix.tables() != nullptr;
  TORCH_CHECK_VALUE(codes.dim() == 4 && (tabled || codes.size(0) == g.batch) && codes.size(1) == g.kv_heads &&
                        codes.size(-1) * 8 == g.dim * bits,
                    "rkv.", op, ": ", p, " must have shape (", pages, tabled ? "" : "=", tabled ? "" : std::to_string(g.batch),
                    ", kv_heads=", g.kv_heads, ", ", ix.paged ? "page_size" : "capacity", ", ", g.dim * bits / 8,
                    ") for head_dim ", g.dim, " at ", bits, " bits, got ", codes.sizes());
  TORCH_CHECK_VALUE(scale.dim() == 4 && scale.size(0) == codes.size(0) && scale.size(1) == g.kv_heads, "rkv.", op, ": ",
                    sc, " must have shape (", codes.size(0), ", ", g.kv_heads, ", blocks, groups), got ", scale.sizes());
  const int64_t rows = codes.size(2), nb = scale.size(2), ng = scale.size(3);
  TORCH_CHECK_VALUE(ng >= 1 && g.dim % ng == 0, "rkv.", op, ": ", sc, "'s last dim (", ng,
                    " groups) must divide head_dim (", g.dim, ")");
  TORCH_CHECK_VALUE((nb >= 1 && rows % nb == 0 && g.block % (rows / nb) == 0) || (nb == 0 && rows == 0), "rkv.", op,
                    ": ", sc, " has ", nb, " token blocks for ", rows, " rows: its block size must divide block (",
                    g.block, ")");
  TORCH_CHECK_VALUE(rows_contiguous(codes) && rows_contiguous(scale), "rkv.", op, ": ", p, " and ", sc,
                    " must be contiguous within each page (their pages may be any stride apart)");
  block_tokens = nb == 0 ? 1 : rows / nb;
  group = g.dim / ng;
  if (zero.has_value()) {
    TORCH_CHECK_TYPE(zero->scalar_type() == scale.scalar_type(), "rkv.", op, ": ", zr, " must have ", sc, "'s dtype");
    TORCH_CHECK_VALUE(zero->sizes() == scale.sizes(), "rkv.", op, ": ", zr, " must have ", sc, "'s shape ",
                      scale.sizes(), ", got ", zero->sizes());
    TORCH_CHECK_VALUE(rows_contiguous(*zero) && zero->stride(0) == scale.stride(0), "rkv.", op, ": ", zr,
                      " must be laid out as ", sc, " (contiguous within each page, the same page stride)");
    check_same_device(op, ref, zr.c_str(), *zero);
  }
}

// Full-precision side rows (slots, H, rows, D).
void check_side_rows(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t,
                     const at::Tensor& like, const CacheIndex& ix, const CacheGeometry& g) {
  check_float_input(op, name, t);
  check_same_device(op, ref, name, t);
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), "rkv.", op, ": ", name, " must have k_window's dtype (",
                   like.scalar_type(), "), got ", t.scalar_type());
  const bool slotted = ix.slots() != nullptr;
  TORCH_CHECK_VALUE(t.dim() == 4 && (slotted || t.size(0) == g.batch) && t.size(1) == g.kv_heads && t.size(3) == g.dim,
                    "rkv.", op, ": ", name, " must have shape (", slotted ? "slots" : std::to_string(g.batch), ", ",
                    g.kv_heads, ", tokens, ", g.dim, "), got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "rkv.", op, ": ", name, " must be contiguous");
}

void check_index_tensor(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t, int64_t dims,
                        int64_t batch) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, "rkv.", op, ": ", name, " must be int32 (got ", t.scalar_type(), ")");
  check_same_device(op, ref, name, t);
  TORCH_CHECK_VALUE(t.dim() == dims && t.size(0) == batch, "rkv.", op, ": ", name, " must have shape (", batch,
                    dims == 2 ? ", max_pages" : "", ",) with one row per sequence, got ", t.sizes());
  TORCH_CHECK_VALUE(t.is_contiguous(), "rkv.", op, ": ", name, " must be contiguous");
}

}  // namespace

void check_cache(const char* op, const at::Tensor& ref, const CacheTensors& c, const CacheIndex& ix,
                 const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                 CacheGeometry& g) {
  TORCH_CHECK_VALUE(block >= 1, "rkv.", op, ": block must be >= 1 (got ", block, ")");
  TORCH_CHECK_VALUE(recent >= 0, "rkv.", op, ": recent must be >= 0 (got ", recent, ")");
  TORCH_CHECK_VALUE(g.dim >= 1 && g.kv_heads >= 1, "rkv.", op, ": head_dim (", g.dim, ") and kv_heads (", g.kv_heads,
                    ") must be >= 1");
  g.block = block;
  g.recent = recent;
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kLong || lengths.scalar_type() == at::kInt, "rkv.", op,
                   ": lengths must be int32 or int64 (got ", lengths.scalar_type(), ")");
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == g.batch, "rkv.", op, ": lengths must have shape (",
                    g.batch, ",), got ", lengths.sizes());
  check_same_device(op, ref, "lengths", lengths);
  if (const at::Tensor* t = ix.tables()) check_index_tensor(op, "block_tables", ref, *t, 2, g.batch);
  if (const at::Tensor* t = ix.slots()) check_index_tensor(op, "side_slots", ref, *t, 1, g.batch);
  check_cache_quantized(op, "k", ref, c.k_codes, c.k_scale, c.k_zero, k_bits, ix, g, g.k_block_tokens, g.k_group);
  check_cache_quantized(op, "v", ref, c.v_codes, c.v_scale, c.v_zero, v_bits, ix, g, g.v_block_tokens, g.v_group);
  const char* vc = ix.paged ? "v_codes" : "v_packed";
  const char* kc = ix.paged ? "k_codes" : "k_packed";
  TORCH_CHECK_VALUE(c.v_codes.size(0) == c.k_codes.size(0) && c.v_codes.size(2) == c.k_codes.size(2), "rkv.", op, ": ",
                    vc, " ", c.v_codes.sizes(), " must have ", kc, "'s pages and rows ", c.k_codes.sizes());
  g.pages = c.k_codes.size(0);
  g.page_size = c.k_codes.size(2);
  g.max_pages = ix.tables() ? ix.tables()->size(1) : 1;
  TORCH_CHECK_VALUE(g.page_size < (int64_t{1} << 31), "rkv.", op, ": the ", ix.paged ? "page size" : "packed capacity",
                    " (", g.page_size, ") must be below 2^31 rows");  // the kernels' 32-bit row arithmetic
  TORCH_CHECK_VALUE(g.page_size % block == 0, "rkv.", op, ": the ", ix.paged ? "page size" : "packed capacity", " (",
                    g.page_size, ") must be a multiple of block (", block, ")");
  g.ring = ix.tables() == nullptr && g.sliding_window > 0;  // sequence b owns page b: a ring
  TORCH_CHECK_VALUE(!g.ring || g.page_size >= ring_rows(g.sliding_window, block), "rkv.", op,
                    ": a sliding window of ", g.sliding_window, " tokens needs a ring of at least ",
                    ring_rows(g.sliding_window, block), " packed rows (k_packed has ", g.page_size, ")");
  g.k_bits = static_cast<int>(k_bits);
  g.v_bits = static_cast<int>(v_bits);
  check_side_rows(op, "k_window", ref, c.k_window, c.k_window, ix, g);
  check_side_rows(op, "v_window", ref, c.v_window, c.k_window, ix, g);
  check_side_rows(op, "k_sink", ref, c.k_sink, c.k_window, ix, g);
  check_side_rows(op, "v_sink", ref, c.v_sink, c.k_window, ix, g);
  g.window = c.k_window.size(2);
  g.sinks = c.k_sink.size(2);
  g.slots = c.k_window.size(0);
  TORCH_CHECK_VALUE(c.v_window.size(2) == g.window && c.v_sink.size(2) == g.sinks && c.k_sink.size(0) == g.slots &&
                        c.v_window.size(0) == g.slots && c.v_sink.size(0) == g.slots,
                    "rkv.", op, ": k_window, v_window, k_sink and v_sink must have the same slots, and the windows ",
                    "(and the sinks) the same rows");
  TORCH_CHECK_VALUE(g.window >= recent + block - 1, "rkv.", op, ": the window ring (", g.window,
                    " tokens) must hold recent + block - 1 = ", recent + block - 1, " tokens");
}

void check_window_and_cap(const char* op, int64_t sliding_window, double softcap, CacheGeometry& g) {
  TORCH_CHECK_VALUE(sliding_window >= 0, "rkv.", op, ": sliding_window must be >= 0 (0: none), got ", sliding_window);
  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, "rkv.", op,
                    ": softcap must be finite and >= 0 (0: none), got ", softcap);
  g.sliding_window = sliding_window;
  g.softcap = static_cast<float>(softcap);
}

void check_attention_extras(const char* op, const at::Tensor& q, const std::optional<at::Tensor>& rope_cos,
                            const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                            const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                            int64_t split_tokens, CacheGeometry& g) {
  TORCH_CHECK_VALUE(split_tokens >= 0, "rkv.", op, ": split_tokens must be >= 0 (got ", split_tokens, ")");
  g.split_tokens = split_tokens;
  TORCH_CHECK_VALUE(rope_cos.has_value() == rope_sin.has_value(), "rkv.", op,
                    ": give both rope_cos and rope_sin (pre-RoPE keys) or neither");
  if (rope_cos.has_value()) {
    check_float_input(op, "rope_cos", *rope_cos);
    check_same_device(op, q, "rope_cos", *rope_cos);
    check_same_device(op, q, "rope_sin", *rope_sin);
    TORCH_CHECK_TYPE(rope_sin->scalar_type() == rope_cos->scalar_type(), "rkv.", op,
                     ": rope_sin must have rope_cos's dtype");
    TORCH_CHECK_VALUE(rope_cos->dim() == 2 && rope_sin->sizes() == rope_cos->sizes() && rope_cos->size(1) >= 1 &&
                          2 * rope_cos->size(1) <= g.dim,
                      "rkv.", op, ": rope_cos / rope_sin must have shape (positions, rot_dim / 2) with ",
                      "rot_dim <= head_dim (", g.dim, "), got ", rope_cos->sizes(), " and ", rope_sin->sizes());
    TORCH_CHECK_VALUE(!k_signs.has_value(), "rkv.", op, ": keys cannot be both pre-RoPE (rope_cos) and ",
                      "Hadamard-rotated (k_signs): RoPE does not commute with the rotation");
    g.rope_half = rope_cos->size(1);
    g.rope_positions = rope_cos->size(0);
  }
  g.interleaved = rope_interleaved;
  for (const auto& [name, s] : {std::pair<const char*, const std::optional<at::Tensor>&>{"k_signs", k_signs},
                                std::pair<const char*, const std::optional<at::Tensor>&>{"v_signs", v_signs}}) {
    if (!s.has_value()) continue;
    check_float_input(op, name, *s);
    check_same_device(op, q, name, *s);
    TORCH_CHECK_VALUE(s->dim() == 1 && s->size(0) == g.dim, "rkv.", op, ": ", name, " must have shape (", g.dim,
                      ",), got ", s->sizes());
    TORCH_CHECK_VALUE(hadamard_block(g.dim) >= 2, "rkv.", op, ": ", name, " needs an even head_dim");
  }
}

void check_query_start_loc(const char* op, const at::Tensor& ref, const at::Tensor& query_start_loc, int64_t batch) {
  TORCH_CHECK_TYPE(query_start_loc.scalar_type() == at::kLong || query_start_loc.scalar_type() == at::kInt, "rkv.", op,
                   ": query_start_loc must be int32 or int64 (got ", query_start_loc.scalar_type(), ")");
  TORCH_CHECK_VALUE(query_start_loc.dim() == 1 && query_start_loc.size(0) == batch + 1, "rkv.", op,
                    ": query_start_loc must have shape (", batch + 1, ",) (batch + 1 cumulative counts), got ",
                    query_start_loc.sizes());
  check_same_device(op, ref, "query_start_loc", query_start_loc);
}

std::vector<int64_t> token_counts(const at::Tensor& qsl) {
  const int64_t* s = qsl.const_data_ptr<int64_t>();
  std::vector<int64_t> m(qsl.size(0) - 1);
  for (size_t b = 0; b < m.size(); ++b) m[b] = s[b + 1] - s[b];
  return m;
}

void check_cache_data(const char* op, const CacheGeometry& g, const PageTable& pt, const int64_t* n, const int64_t* m) {
  for (int64_t b = 0; b < g.batch; ++b) {
    const int64_t add = m != nullptr ? m[b] : 0, total = n[b] + add;
    TORCH_CHECK_VALUE(n[b] >= 0 && add >= 0, "rkv.", op, ": sequence ", b, " has ", n[b], " cached and ", add,
                      " new tokens (query_start_loc must not decrease)");
    if (m != nullptr) {
      TORCH_CHECK_VALUE(total <= g.max_tokens(), "rkv.", op, ": appending ", add, " tokens to sequence ", b, " of ",
                        n[b], " tokens exceeds its capacity of ", g.max_tokens(), " tokens (", g.max_pages,
                        g.max_pages == 1 ? " page" : " pages", " of ", g.page_size, ")");
    } else {
      TORCH_CHECK_VALUE(total <= g.max_tokens(), "rkv.", op, ": lengths[", b, "] = ", n[b], " is outside [0, ",
                        g.max_tokens(), "] (", g.max_pages, g.max_pages == 1 ? " page" : " pages", " of ",
                        g.page_size, " tokens)");
    }
    TORCH_CHECK_VALUE(g.rope_half == 0 || total <= g.rope_positions, "rkv.", op, ": sequence ", b, " needs rope ",
                      "positions up to ", total - 1, " but rope_cos has ", g.rope_positions);
    const int64_t slot = pt.slot(b);
    TORCH_CHECK_VALUE(slot >= 0 && slot < g.slots, "rkv.", op, ": side_slots[", b, "] = ", slot,
                      " is outside the ", g.slots, " side slots");
    for (int64_t j = 0; j * g.page_size < total; ++j) {
      const int64_t page = pt.page(b, j * g.page_size);
      TORCH_CHECK_VALUE(page >= 0 && page < g.pages, "rkv.", op, ": block_tables[", b, "][", j, "] = ", page,
                        " is outside the pool of ", g.pages, " pages");
    }
  }
}

void check_outliers(const char* op, const char* arg, const at::Tensor& ref, const std::optional<at::Tensor>& outliers,
                    const at::Tensor& codes, const CacheGeometry& g) {
  if (!outliers.has_value()) return;
  const at::Tensor& t = *outliers;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, "rkv.", op, ": ", arg, " must be int32 (got ", t.scalar_type(), ")");
  check_same_device(op, ref, arg, t);
  const int64_t blocks = codes.size(2) / g.block;
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == codes.size(0) && t.size(1) == g.kv_heads && t.size(2) == blocks &&
                        t.size(3) >= 1,
                    "rkv.", op, ": ", arg, " must have shape (", codes.size(0), ", ", g.kv_heads, ", ", blocks,
                    ", outliers per block >= 1): one row of entries per block of ", g.block, " rows, got ", t.sizes());
  TORCH_CHECK_VALUE(rows_contiguous(t), "rkv.", op, ": ", arg,
                    " must be contiguous within each page (its pages may be any stride apart)");
  TORCH_CHECK_VALUE(g.block * g.dim <= 0xFFFF, "rkv.", op, ": ", arg, ": outlier positions are 16 bits, so block x "
                    "head_dim must be <= 65535 (got ", g.block, " x ", g.dim, ")");
}

at::Tensor check_refine(const char* op, const at::Tensor& ref, const std::optional<at::Tensor>& refine,
                        const std::optional<at::Tensor>& channels, const at::Tensor& codes, bool asymmetric,
                        bool uniform, bool outliers, const CacheGeometry& g) {
  TORCH_CHECK_VALUE(refine.has_value() == channels.has_value(), "rkv.", op, ": k_refine and k_channels come together "
                    "(the refinement codes and which channels they refine)");
  if (!refine.has_value()) return at::Tensor();
  const at::Tensor& r = *refine;
  const at::Tensor& c = *channels;
  TORCH_CHECK_TYPE(c.scalar_type() == at::kInt, "rkv.", op, ": k_channels must be int32 (got ", c.scalar_type(), ")");
  TORCH_CHECK_TYPE(r.scalar_type() == at::kByte, "rkv.", op, ": k_refine must be uint8 (got ", r.scalar_type(), ")");
  check_same_device(op, ref, "k_refine", r);
  check_same_device(op, ref, "k_channels", c);
  TORCH_CHECK_VALUE(c.dim() == 2 && c.size(0) == g.kv_heads && c.size(1) >= 1 && c.size(1) <= g.dim &&
                        c.size(1) <= kMaxRefined,
                    "rkv.", op, ": k_channels must have shape (kv_heads=", g.kv_heads, ", m) with 1 <= m <= min(head_dim=",
                    g.dim, ", ", kMaxRefined, "), got ", c.sizes());
  const int64_t m = c.size(1);
  TORCH_CHECK_VALUE(r.dim() == 4 && r.size(0) == codes.size(0) && r.size(1) == g.kv_heads && r.size(2) == codes.size(2) &&
                        r.size(3) * 8 % m == 0 && r.size(3) * 8 / m >= 2 && r.size(3) * 8 / m <= 4,
                    "rkv.", op, ": k_refine must have shape (", codes.size(0), ", ", g.kv_heads, ", ", codes.size(2),
                    ", m * extra / 8) with m = ", m, " refined channels of extra = 2, 3 or 4 bits each, got ", r.sizes());
  TORCH_CHECK_VALUE(rows_contiguous(r), "rkv.", op,
                    ": k_refine must be contiguous within each page (its pages may be any stride apart)");
  TORCH_CHECK_VALUE(asymmetric && uniform && !outliers && g.k_group == 1 && g.k_bits < 8, "rkv.", op,
                    ": k_refine refines per-channel key codes: it needs asymmetric keys (k_zero), one channel per "
                    "group, uniform codes below 8 bits (no k_levels) and no k_outliers");
  const at::Tensor cc = c.contiguous();
  if (cc.is_cpu()) {
    std::vector<bool> seen(g.dim);
    const int32_t* v = cc.const_data_ptr<int32_t>();
    for (int64_t h = 0; h < g.kv_heads; ++h) {
      std::fill(seen.begin(), seen.end(), false);
      for (int64_t j = 0; j < m; ++j) {
        const int32_t ch = v[h * m + j];
        TORCH_CHECK_VALUE(ch >= 0 && ch < g.dim && !seen[ch], "rkv.", op, ": k_channels[", h, "] must name distinct "
                          "channels in [0, head_dim=", g.dim, "); entry ", j, " is ", ch);
        seen[ch] = true;
      }
    }
  }
  return cc;
}

}  // namespace rkv
