#include "checks.h"

#include <ATen/core/Tensor.h>

#include "rkv/hadamard.h"
#include "rkv/pack.h"

namespace rkv {

namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checked once per op family: the shape of x without its last two dims.
std::vector<int64_t> lead_shape(const at::Tensor& t) {
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end() - 2);
}

}  // namespace

void check_bits(const char* op, const char* arg, int64_t bits) {
  TORCH_CHECK_VALUE(valid_bits(bits), "rkv.", op, ": ", arg, " must be 2, 3, 4 or 8 (got ", bits, ")");
}

void check_float_input(const char* op, const char* arg, const at::Tensor& t) {
  TORCH_CHECK_TYPE(is_float_type(t.scalar_type()), "rkv.", op, ": ", arg,
                   " must be float32, float16 or bfloat16 (got ", t.scalar_type(), ")");
}

void check_meta_dtype(const char* op, const char* arg, at::ScalarType dtype) {
  TORCH_CHECK_TYPE(is_float_type(dtype), "rkv.", op, ": ", arg,
                   " must be float32, float16 or bfloat16 (got ", dtype, ")");
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
                             bool symmetric, at::ScalarType meta_dtype, bool clip) {
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
  return g;
}

QuantGeometry check_dequantize(const at::Tensor& packed, const at::Tensor& scale,
                               const std::optional<at::Tensor>& zero, int64_t bits, at::ScalarType out_dtype) {
  check_bits("dequantize", "bits", bits);
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "rkv.dequantize: packed must be uint8 (got ",
                   packed.scalar_type(), ")");
  check_float_input("dequantize", "scale", scale);
  check_meta_dtype("dequantize", "out_dtype", out_dtype);
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

// One quantized tensor of the cache: packed (B, H, C, D*bits/8), scale/zero (B, H, C/T, D/G).
void check_cache_quantized(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& packed,
                           const at::Tensor& scale, const std::optional<at::Tensor>& zero, int64_t bits,
                           int64_t block, DecodeGeometry& g, int64_t& block_tokens, int64_t& group) {
  const std::string p = std::string(name) + "_packed", sc = std::string(name) + "_scale",
                    zr = std::string(name) + "_zero";
  check_bits(op, (std::string(name) + "_bits").c_str(), bits);
  TORCH_CHECK_TYPE(packed.scalar_type() == at::kByte, "rkv.", op, ": ", p, " must be uint8 (got ",
                   packed.scalar_type(), ")");
  check_float_input(op, sc.c_str(), scale);
  check_same_device(op, ref, p.c_str(), packed);
  check_same_device(op, ref, sc.c_str(), scale);
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.size(0) == g.batch && packed.size(1) == g.kv_heads &&
                        packed.size(-1) * 8 == g.dim * bits,
                    "rkv.", op, ": ", p, " must have shape (batch=", g.batch, ", kv_heads=", g.kv_heads,
                    ", capacity, ", g.dim * bits / 8, ") for head_dim ", g.dim, " at ", bits, " bits, got ",
                    packed.sizes());
  TORCH_CHECK_VALUE(scale.dim() == 4 && scale.size(0) == g.batch && scale.size(1) == g.kv_heads, "rkv.", op, ": ",
                    sc, " must have shape (", g.batch, ", ", g.kv_heads, ", blocks, groups), got ", scale.sizes());
  const int64_t cap = packed.size(2), nb = scale.size(2), ng = scale.size(3);
  TORCH_CHECK_VALUE(ng >= 1 && g.dim % ng == 0, "rkv.", op, ": ", sc, "'s last dim (", ng,
                    " groups) must divide head_dim (", g.dim, ")");
  TORCH_CHECK_VALUE((nb >= 1 && cap % nb == 0 && block % (cap / nb) == 0) || (nb == 0 && cap == 0), "rkv.", op, ": ",
                    sc, " has ", nb, " token blocks for ", cap, " packed tokens: its block size must divide block (",
                    block, ")");
  block_tokens = nb == 0 ? 1 : cap / nb;
  group = g.dim / ng;
  if (zero.has_value()) {
    TORCH_CHECK_TYPE(zero->scalar_type() == scale.scalar_type(), "rkv.", op, ": ", zr, " must have ", sc,
                     "'s dtype");
    TORCH_CHECK_VALUE(zero->sizes() == scale.sizes(), "rkv.", op, ": ", zr, " must have ", sc, "'s shape ",
                      scale.sizes(), ", got ", zero->sizes());
    check_same_device(op, ref, zr.c_str(), *zero);
  }
}

void check_full_precision(const char* op, const char* name, const at::Tensor& ref, const at::Tensor& t,
                          const at::Tensor& like, const DecodeGeometry& g) {
  check_float_input(op, name, t);
  check_same_device(op, ref, name, t);
  TORCH_CHECK_TYPE(t.scalar_type() == like.scalar_type(), "rkv.", op, ": ", name, " must have k_window's dtype (",
                   like.scalar_type(), "), got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == g.batch && t.size(1) == g.kv_heads && t.size(3) == g.dim, "rkv.", op,
                    ": ", name, " must have shape (", g.batch, ", ", g.kv_heads, ", tokens, ", g.dim, "), got ",
                    t.sizes());
}

}  // namespace

void check_cache_layout(const char* op, const at::Tensor& ref, const at::Tensor& k_packed, const at::Tensor& k_scale,
                        const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                        const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                        const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                        const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                        int64_t block, int64_t recent, DecodeGeometry& g) {
  TORCH_CHECK_VALUE(block >= 1, "rkv.", op, ": block must be >= 1 (got ", block, ")");
  TORCH_CHECK_VALUE(recent >= 0, "rkv.", op, ": recent must be >= 0 (got ", recent, ")");
  TORCH_CHECK_VALUE(g.dim >= 1 && g.kv_heads >= 1, "rkv.", op, ": head_dim (", g.dim, ") and kv_heads (", g.kv_heads,
                    ") must be >= 1");
  g.block = block;
  g.recent = recent;
  check_cache_quantized(op, "k", ref, k_packed, k_scale, k_zero, k_bits, block, g, g.k_block_tokens, g.k_group);
  check_cache_quantized(op, "v", ref, v_packed, v_scale, v_zero, v_bits, block, g, g.v_block_tokens, g.v_group);
  TORCH_CHECK_VALUE(v_packed.size(2) == k_packed.size(2), "rkv.", op, ": v_packed ", v_packed.sizes(),
                    " must have k_packed's capacity ", k_packed.sizes());
  TORCH_CHECK_TYPE(v_scale.scalar_type() == k_scale.scalar_type(), "rkv.", op, ": v_scale must have k_scale's dtype (",
                   k_scale.scalar_type(), "), got ", v_scale.scalar_type());
  g.capacity = k_packed.size(2);
  TORCH_CHECK_VALUE(g.capacity % block == 0, "rkv.", op, ": the packed capacity (", g.capacity,
                    ") must be a multiple of block (", block, ")");
  g.k_bits = static_cast<int>(k_bits);
  g.v_bits = static_cast<int>(v_bits);
  check_full_precision(op, "k_window", ref, k_window, k_window, g);
  check_full_precision(op, "v_window", ref, v_window, k_window, g);
  check_full_precision(op, "k_sink", ref, k_sink, k_window, g);
  check_full_precision(op, "v_sink", ref, v_sink, k_window, g);
  g.window = k_window.size(2);
  g.sinks = k_sink.size(2);
  TORCH_CHECK_VALUE(v_window.size(2) == g.window && v_sink.size(2) == g.sinks, "rkv.", op,
                    ": v_window / v_sink must hold as many tokens as k_window / k_sink");
  TORCH_CHECK_VALUE(g.window >= recent + block - 1, "rkv.", op, ": the window ring (", g.window,
                    " tokens) must hold recent + block - 1 = ", recent + block - 1, " tokens");
  TORCH_CHECK_TYPE(lengths.scalar_type() == at::kLong || lengths.scalar_type() == at::kInt, "rkv.", op,
                   ": lengths must be int32 or int64 (got ", lengths.scalar_type(), ")");
  TORCH_CHECK_VALUE(lengths.dim() == 1 && lengths.size(0) == g.batch, "rkv.", op, ": lengths must have shape (",
                    g.batch, ",), got ", lengths.sizes());
  check_same_device(op, ref, "lengths", lengths);
}

DecodeGeometry check_decode_attention(
    const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
    const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed, const at::Tensor& v_scale,
    const std::optional<at::Tensor>& v_zero, const at::Tensor& k_window, const at::Tensor& v_window,
    const at::Tensor& k_sink, const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
    int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
    bool rope_interleaved, const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
    int64_t split_tokens) {
  const char* op = "decode_attention";
  check_float_input(op, "q", q);
  TORCH_CHECK_VALUE(q.dim() == 3, "rkv.decode_attention: q must have shape (batch, q_heads, head_dim), got ",
                    q.sizes());
  DecodeGeometry g;
  g.batch = q.size(0);
  g.q_heads = q.size(1);
  g.dim = q.size(2);
  TORCH_CHECK_VALUE(split_tokens >= 0, "rkv.decode_attention: split_tokens must be >= 0 (got ", split_tokens, ")");
  g.split_tokens = split_tokens;
  TORCH_CHECK_VALUE(k_packed.dim() == 4, "rkv.decode_attention: k_packed must have shape (batch, kv_heads, "
                    "capacity, bytes), got ", k_packed.sizes());
  g.kv_heads = k_packed.size(1);
  TORCH_CHECK_VALUE(g.kv_heads >= 1 && g.q_heads % g.kv_heads == 0, "rkv.decode_attention: q has ", g.q_heads,
                    " heads, which is not a multiple of the cache's ", g.kv_heads, " kv heads");
  check_cache_layout(op, q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink, v_sink,
                     lengths, k_bits, v_bits, block, recent, g);
  TORCH_CHECK_VALUE(rope_cos.has_value() == rope_sin.has_value(),
                    "rkv.decode_attention: give both rope_cos and rope_sin (pre-RoPE keys) or neither");
  if (rope_cos.has_value()) {
    check_float_input(op, "rope_cos", *rope_cos);
    check_same_device(op, q, "rope_cos", *rope_cos);
    check_same_device(op, q, "rope_sin", *rope_sin);
    TORCH_CHECK_TYPE(rope_sin->scalar_type() == rope_cos->scalar_type(),
                     "rkv.decode_attention: rope_sin must have rope_cos's dtype");
    TORCH_CHECK_VALUE(rope_cos->dim() == 2 && rope_sin->sizes() == rope_cos->sizes() && rope_cos->size(1) >= 1 &&
                          2 * rope_cos->size(1) <= g.dim,
                      "rkv.decode_attention: rope_cos / rope_sin must have shape (positions, rot_dim / 2) with ",
                      "rot_dim <= head_dim (", g.dim, "), got ", rope_cos->sizes(), " and ", rope_sin->sizes());
    TORCH_CHECK_VALUE(!k_signs.has_value(), "rkv.decode_attention: keys cannot be both pre-RoPE (rope_cos) and ",
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
    TORCH_CHECK_VALUE(s->dim() == 1 && s->size(0) == g.dim, "rkv.decode_attention: ", name, " must have shape (",
                      g.dim, ",), got ", s->sizes());
    TORCH_CHECK_VALUE(hadamard_block(g.dim) >= 2, "rkv.decode_attention: ", name, " needs an even head_dim");
  }
  return g;
}

DecodeGeometry check_cache_append(const at::Tensor& k_packed, const at::Tensor& k_scale,
                                  const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                                  const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                                  const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                                  const at::Tensor& v_sink, const at::Tensor& lengths, const at::Tensor& k_new,
                                  const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block,
                                  int64_t recent, bool k_clip, bool v_clip) {
  const char* op = "cache_append";
  TORCH_CHECK_VALUE(!(k_clip && !k_zero.has_value()), "rkv.cache_append: k_clip needs asymmetric keys (k_zero)");
  TORCH_CHECK_VALUE(!(v_clip && !v_zero.has_value()), "rkv.cache_append: v_clip needs asymmetric values (v_zero)");
  check_float_input(op, "k_new", k_new);
  TORCH_CHECK_VALUE(k_new.dim() == 4, "rkv.cache_append: k_new must have shape (batch, kv_heads, tokens, head_dim), ",
                    "got ", k_new.sizes());
  TORCH_CHECK_VALUE(v_new.sizes() == k_new.sizes(), "rkv.cache_append: v_new must have k_new's shape ",
                    k_new.sizes(), ", got ", v_new.sizes());
  DecodeGeometry g;
  g.batch = k_new.size(0);
  g.kv_heads = k_new.size(1);
  g.q_heads = g.kv_heads;
  g.dim = k_new.size(3);
  check_cache_layout(op, k_new, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window, k_sink,
                     v_sink, lengths, k_bits, v_bits, block, recent, g);
  TORCH_CHECK_TYPE(k_new.scalar_type() == k_window.scalar_type() && v_new.scalar_type() == k_window.scalar_type(),
                   "rkv.cache_append: k_new and v_new must have the cache's full-precision dtype (k_window: ",
                   k_window.scalar_type(), "), got ", k_new.scalar_type(), " and ", v_new.scalar_type());
  check_same_device(op, k_new, "v_new", v_new);
  const std::pair<const char*, const at::Tensor*> written[] = {
      {"k_packed", &k_packed}, {"k_scale", &k_scale}, {"v_packed", &v_packed}, {"v_scale", &v_scale},
      {"k_window", &k_window}, {"v_window", &v_window}, {"k_sink", &k_sink},   {"v_sink", &v_sink}};
  for (const auto& [name, t] : written)
    TORCH_CHECK_VALUE(t->is_contiguous(), "rkv.cache_append: ", name, " must be contiguous (it is written in place)");
  if (k_zero.has_value()) TORCH_CHECK_VALUE(k_zero->is_contiguous(), "rkv.cache_append: k_zero must be contiguous");
  if (v_zero.has_value()) TORCH_CHECK_VALUE(v_zero->is_contiguous(), "rkv.cache_append: v_zero must be contiguous");
  return g;
}

void check_append_lengths(const DecodeGeometry& g, const at::Tensor& lengths, int64_t tokens) {
  const int64_t* n = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < g.batch; ++b)
    TORCH_CHECK_VALUE(n[b] >= 0 && n[b] + tokens <= g.max_tokens(), "rkv.cache_append: appending ", tokens,
                      " tokens to sequence ", b, " of ", n[b], " tokens exceeds the cache capacity of ", g.max_tokens(),
                      " tokens (sinks ", g.sinks, " + packed ", g.capacity, " + recent ", g.recent, ")");
}

void check_decode_lengths(const DecodeGeometry& g, const at::Tensor& lengths) {
  const int64_t* n = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < g.batch; ++b) {
    TORCH_CHECK_VALUE(n[b] >= 0 && n[b] <= g.max_tokens(), "rkv.decode_attention: lengths[", b, "] = ", n[b],
                      " is outside [0, ", g.max_tokens(), "] (sinks ", g.sinks, " + packed capacity ", g.capacity,
                      " + recent ", g.recent, ")");
    TORCH_CHECK_VALUE(g.rope_half == 0 || n[b] <= g.rope_positions, "rkv.decode_attention: lengths[", b, "] = ",
                      n[b], " needs rope positions up to ", n[b] - 1, " but rope_cos has ", g.rope_positions);
  }
}

}  // namespace rkv
