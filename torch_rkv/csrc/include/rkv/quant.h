// Per-element quantization math: group parameters, encode, decode.
//
// A group is a tile of `block_tokens` tokens x `group_size` channels that shares one scale (and one
// zero for asymmetric quantization). The spec is torch_rkv/reference.py (quantize / dequantize); this
// header is its arithmetic, shared by the CPU and CUDA kernels and bit-exact with the reference.
//
// Asymmetric:  zero  = min rounded DOWN to the metadata dtype,
//              scale = (max - zero) / (2^b - 1) rounded UP to the metadata dtype,
//              code  = clamp(rint((x - zero) / scale), 0, 2^b - 1),  x_hat = code * scale + zero.
// Symmetric:   scale = max|x| / (2^(b-1) - 1) rounded UP,  code = clamp(rint(x / scale), -q, q) + 2^(b-1),
//              x_hat = (code - 2^(b-1)) * scale.
// Rounding the metadata outward (instead of to nearest) keeps every finite input inside the grid the
// stored fp16 scale describes, so |x - x_hat| <= scale / 2 holds for the *stored* scale.
//
// Clipped ranges (clip=True, asymmetric only): a group's range is chosen among kClipSteps candidates
// [lo + j*step, hi - j*step], step = (hi - lo) * 0.025, j = 0..10 (up to 25% of the span cut off each
// side), as the one whose codes give the least squared error over the group's finite values (summed
// in double; ties keep the wider range). At 2 bits min/max wastes levels on a channel's few extreme
// tokens; the search trades them for a finer grid (Lloyd-Max style, restricted to a uniform grid).
//
// Non-uniform levels (a codebook; asymmetric only): `lut` holds the 2^b code values in code units,
// ascending within [0, 2^b - 1] (the uniform grid is lut[c] = c). x_hat = lut[code] * scale + zero, and
// code = the number of midpoints (lut[i] + lut[i+1]) * 0.5 that (x - zero) / scale exceeds: the nearest
// level, ties toward the lower one. Group parameters and the clip search are unchanged; only the grid
// inside [zero, zero + (2^b - 1) scale] moves (docs/format.md, "Non-uniform levels").
//
// Non-finite inputs never poison their group: min/max are taken over finite values only, +-Inf
// saturate to the ends of the grid and NaN is stored as 0 (or the grid value nearest 0). Values
// beyond the metadata dtype's range (|x| > 65504 for fp16, 448 for float8 e4m3) saturate the same way:
// the bound above holds for values inside that range.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cmath>
#include <type_traits>

#include "rkv/macros.h"

namespace rkv {

RKV_HD int levels(int bits) { return (1 << bits) - 1; }   // largest asymmetric code
RKV_HD int sym_bias(int bits) { return 1 << (bits - 1); } // stored code of the value 0
RKV_HD int sym_qmax(int bits) { return (1 << (bits - 1)) - 1; }

RKV_HD bool is_finite(float x) { return fabsf(x) <= 3.402823466e38f; }  // false for NaN and +-Inf

// Clamp of a value known not to be NaN; a select, so CPU loops vectorize (fminf is a libm call).
RKV_HD float clamp_f(float v, float lo, float hi) { return v < lo ? lo : (v > hi ? hi : v); }

// Largest finite value of each metadata dtype.
template <typename M> struct MetaMax;
template <> struct MetaMax<float> { static constexpr float value = 3.402823466e38f; };
template <> struct MetaMax<c10::Half> { static constexpr float value = 65504.0f; };
template <> struct MetaMax<c10::BFloat16> { static constexpr float value = 3.38953139e38f; };
template <> struct MetaMax<c10::Float8_e4m3fn> { static constexpr float value = 448.0f; };

// Next representable 16-bit (Half, BFloat16) or 8-bit (Float8_e4m3fn) float toward +Inf (up) or -Inf
// (down), one step of the sign-magnitude bit pattern. h must not be the largest finite value stepping
// away from zero (the caller clamps first).
template <typename M>
RKV_HD M next_toward(M h, bool up) {
  using Bits = decltype(h.x);
  constexpr unsigned sign = 1u << (8 * sizeof(Bits) - 1);
  unsigned b = h.x;
  const bool neg = (b & sign) != 0;
  if ((b & (sign - 1)) == 0) {
    b = up ? 0x1u : (sign | 0x1u);  // smallest subnormal of the right sign
  } else if (neg == up) {
    b = b - 1;  // toward zero
  } else {
    b = b + 1;  // away from zero
  }
  return M(static_cast<Bits>(b), M::from_bits());
}

// v rounded to metadata dtype M toward +Inf (up) or -Inf (down), returned as the exact float value,
// saturated to M's finite range. v must be finite.
template <typename M>
RKV_HD float round_meta(double v, bool up) {
  float f = static_cast<float>(v);
  if (up ? static_cast<double>(f) < v : static_cast<double>(f) > v) {
    f = nextafterf(f, up ? INFINITY : -INFINITY);
  }
  const float mx = MetaMax<M>::value;
  f = fminf(fmaxf(f, -mx), mx);
  if constexpr (!std::is_same<M, float>::value) {
    M h(f);
    const float hf = static_cast<float>(h);
    if (up ? hf < f : hf > f) h = next_toward(h, up);
    f = static_cast<float>(h);
  }
  return f;
}

struct QParams {
  float scale;
  float zero;
};

// Group parameters from the min (lo) and max (hi) of the group's finite values. lo > hi (the
// initial empty range) means the group had no finite value: scale 0, zero 0.
template <typename M>
RKV_HD QParams make_qparams(float lo, float hi, int bits, bool symmetric) {
  if (!(lo <= hi)) return {0.0f, 0.0f};
  lo = add_rn(lo, 0.0f);  // -0 -> +0: min/max reductions may meet -0 and +0 in any order
  hi = add_rn(hi, 0.0f);
  if (symmetric) {
    const float amax = fmaxf(fabsf(lo), fabsf(hi));
    return {round_meta<M>(static_cast<double>(amax) / sym_qmax(bits), true), 0.0f};
  }
  const float zero = round_meta<M>(static_cast<double>(lo), false);
  const double span = static_cast<double>(hi) - static_cast<double>(zero);
  return {round_meta<M>(span / levels(bits), true), zero};
}

// The code value of `code` in code units: lut[code], or the code itself (uniform; lut == nullptr).
RKV_HD float code_value(uint32_t code, const float* lut) { return lut != nullptr ? lut[code] : static_cast<float>(code); }

// The nearest of the 2^bits levels of lut to u (code units), ties toward the lower; NaN-free u.
RKV_HD uint32_t nearest_level(float u, const float* lut, int bits) {
  uint32_t code = 0;
  for (int i = 0; i + 1 < (1 << bits); ++i) code += u > mul_rn(add_rn(lut[i], lut[i + 1]), 0.5f) ? 1u : 0u;
  return code;
}

RKV_HD uint32_t encode(float x, QParams p, int bits, bool symmetric, const float* lut = nullptr) {
  if (x != x) x = 0.0f;  // NaN
  if (lut != nullptr) return nearest_level(p.scale > 0.0f ? div_rn(sub_rn(x, p.zero), p.scale) : 0.0f, lut, bits);
  if (symmetric) {
    const float qm = static_cast<float>(sym_qmax(bits));
    const float q = p.scale > 0.0f ? rintf(div_rn(x, p.scale)) : 0.0f;
    return static_cast<uint32_t>(static_cast<int>(clamp_f(q, -qm, qm)) + sym_bias(bits));
  }
  const float q = p.scale > 0.0f ? rintf(div_rn(sub_rn(x, p.zero), p.scale)) : 0.0f;
  return static_cast<uint32_t>(clamp_f(q, 0.0f, static_cast<float>(levels(bits))));
}

RKV_HD float decode(uint32_t code, QParams p, int bits, bool symmetric, const float* lut = nullptr) {
  if (lut != nullptr) return add_rn(mul_rn(lut[code], p.scale), p.zero);
  if (symmetric) return mul_rn(static_cast<float>(static_cast<int>(code) - sym_bias(bits)), p.scale);
  return add_rn(mul_rn(static_cast<float>(code), p.scale), p.zero);
}

// Refined key channels (reference.refine_codes / refine_residual): the extra-bit code of where x lies
// within its code's cell, and what that code adds to the channel's decoded value.
RKV_HD uint32_t refine_code(float x, QParams p, int bits, int extra) {
  if (x != x) x = 0.0f;  // NaN, as encode takes it
  const float u = p.scale > 0.0f ? div_rn(sub_rn(x, p.zero), p.scale) : 0.0f;
  const float c = clamp_f(rintf(u), 0.0f, static_cast<float>(levels(bits)));
  const float cells = static_cast<float>(1 << extra);
  return static_cast<uint32_t>(clamp_f(floorf(mul_rn(add_rn(sub_rn(u, c), 0.5f), cells)), 0.0f, cells - 1.0f));
}

RKV_HD float refine_residual(uint32_t r, float scale, int extra) {
  const int cells = 1 << extra;
  return mul_rn(scale, static_cast<float>(2 * static_cast<int>(r) + 1 - cells) / static_cast<float>(2 * cells));
}

constexpr int kClipSteps = 11;

// Candidate j of the clipped-range search of [lo, hi]; false when it does not exist (j > 0 and the
// span is not finite).
RKV_HD bool clip_candidate(float lo, float hi, int j, float& clo, float& chi) {
  const float step = mul_rn(sub_rn(hi, lo), 0.025f);
  if (j > 0 && !is_finite(step)) return false;
  const float cut = mul_rn(static_cast<float>(j), step);
  clo = add_rn(lo, cut);
  chi = sub_rn(hi, cut);
  return true;
}

// Squared reconstruction error of one value under asymmetric parameters p; 0 for non-finite values
// (they saturate whatever the range).
RKV_HD double clip_error(float x, QParams p, int bits, const float* lut = nullptr) {
  if (!is_finite(x)) return 0.0;
  const float e = sub_rn(decode(encode(x, p, bits, false, lut), p, bits, false, lut), x);
  return static_cast<double>(e) * static_cast<double>(e);
}

// Parameters of the group [lo, hi] (finite min/max) with the clipped-range search; group_error(p)
// returns the sum of clip_error over the group's values. Every CUDA lane of a group calls it alike.
template <typename M, typename GroupError>
RKV_HD QParams clipped_qparams(float lo, float hi, int bits, const GroupError& group_error) {
  QParams best = make_qparams<M>(lo, hi, bits, false);
  if (!(lo <= hi)) return best;
  double best_error = group_error(best);
  for (int j = 1; j < kClipSteps; ++j) {
    float clo, chi;
    if (!clip_candidate(lo, hi, j, clo, chi)) break;
    const QParams p = make_qparams<M>(clo, chi, bits, false);
    const double e = group_error(p);
    if (e < best_error) {
      best = p;
      best_error = e;
    }
  }
  return best;
}

// Running min/max over finite values; starts empty (lo > hi).
struct Range {
  float lo = INFINITY;
  float hi = -INFINITY;
  RKV_HD void add(float x) {
    if (is_finite(x)) {
      lo = fminf(lo, x);
      hi = fmaxf(hi, x);
    }
  }
  RKV_HD void merge(const Range& o) {
    lo = fminf(lo, o.lo);
    hi = fmaxf(hi, o.hi);
  }
};

}  // namespace rkv
