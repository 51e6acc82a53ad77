#include "checks.h"

#include <ATen/ATen.h>

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
                             bool symmetric, at::ScalarType meta_dtype) {
  (void)symmetric;
  check_bits("quantize", "bits", bits);
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

}  // namespace rkv
