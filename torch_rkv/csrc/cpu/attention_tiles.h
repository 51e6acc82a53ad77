// CPU micro-kernels of decode attention over a tile of dequantized rows (float, row-major [t][D]):
//   scores_tile:     s[g][t] = q_g . k_t          for every query head g of a GQA group
//   accumulate_tile: acc[g][:] += p[g][t] * v_t
// In the AVX2 translation unit (capability.h) they are register-blocked: 8 tokens' dot products are reduced together by a transpose
// (one horizontal sum per 8 scores, not per score), and the output accumulators stay in registers
// across the tile. Elsewhere the same loops are written for the auto-vectorizer.
#pragma once

#include <cstdint>
#include <cstring>

#include "capability.h"
#include "decode_kernel.h"
#include "rkv/attention.h"
#include "rkv/macros.h"

#if RKV_CPU_ISA_AVX2
#include <immintrin.h>
#define RKV_TILES_AVX2 1
#else
#define RKV_TILES_AVX2 0
#endif

namespace rkv::cpu {
inline namespace RKV_CPU_ISA {

#if RKV_TILES_AVX2

// The 8 horizontal sums of a[0..7] as one vector: lane i = sum of a[i]'s lanes.
RKV_INLINE __m256 transpose_sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s0123 = _mm256_hadd_ps(s01, s23);  // per 128-bit half: sums of a0..a3 halves
  const __m256 s4567 = _mm256_hadd_ps(s45, s67);
  const __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
  const __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
  return _mm256_add_ps(lo, hi);
}

// Scores of one query row over the tile, 8 tokens' dot products reduced together.
template <int D>
RKV_INLINE void scores_row(const float* __restrict k, int64_t ntok, const float* __restrict qg, float* __restrict s) {
  for (int64_t t0 = 0; t0 < ntok; t0 += 8) {
    __m256 acc[8];
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
    for (int c = 0; c < D; c += 8) {
      const __m256 qv = _mm256_loadu_ps(qg + c);
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k + (t0 + i) * D + c), acc[i]);
    }
    const __m256 sums = transpose_sum8(acc);
    if (ntok - t0 >= 8) {
      _mm256_storeu_ps(s + t0, sums);
    } else {  // the tile's last, partial group of rows
      alignas(32) float out[8];
      _mm256_store_ps(out, sums);
      for (int64_t i = 0; i < ntok - t0; ++i) s[t0 + i] = out[i];
    }
  }
}

// Tile rows beyond ntok must be readable (the caller zero-pads the tile to a multiple of 8 rows). Query
// rows go in pairs over 4 tokens at a time: each key load feeds two FMAs (6 loads per 8 FMAs, where
// one row over 8 tokens needs 9), which is what the many rows of a prefill block and a GQA group gain.
template <int D>
RKV_INLINE void scores_tile(const float* __restrict k, int64_t ntok, const float* __restrict q, int64_t groups,
                            float* __restrict s, int64_t s_stride) {
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    const float* q0 = q + g * D;
    const float* q1 = q0 + D;
    float* s0 = s + g * s_stride;
    float* s1 = s0 + s_stride;
    for (int64_t t0 = 0; t0 < ntok; t0 += 4) {
      __m256 acc[8];  // acc[i]: row 0 with token t0 + i; acc[4 + i]: row 1
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int c = 0; c < D; c += 8) {
        const __m256 a0 = _mm256_loadu_ps(q0 + c), a1 = _mm256_loadu_ps(q1 + c);
        for (int i = 0; i < 4; ++i) {
          const __m256 kv = _mm256_loadu_ps(k + (t0 + i) * D + c);
          acc[i] = _mm256_fmadd_ps(a0, kv, acc[i]);
          acc[4 + i] = _mm256_fmadd_ps(a1, kv, acc[4 + i]);
        }
      }
      const __m256 sums = transpose_sum8(acc);  // lanes 0-3: row 0, lanes 4-7: row 1
      if (ntok - t0 >= 4) {
        _mm_storeu_ps(s0 + t0, _mm256_castps256_ps128(sums));
        _mm_storeu_ps(s1 + t0, _mm256_extractf128_ps(sums, 1));
      } else {
        alignas(32) float out[8];
        _mm256_store_ps(out, sums);
        for (int64_t i = 0; i < ntok - t0; ++i) {
          s0[t0 + i] = out[i];
          s1[t0 + i] = out[4 + i];
        }
      }
    }
  }
  if (g < groups) scores_row<D>(k, ntok, q + g * D, s + g * s_stride);
}

// NG query heads at once, CB chunks of 8 channels per pass (NG x CB accumulators kept in registers over
// the tile; each value load feeds NG FMAs and each probability broadcast CB of them).
template <int D, int NG, int CB>
RKV_INLINE void accumulate_tile_heads(const float* __restrict v, int64_t ntok, const float* __restrict p,
                                      int64_t p_stride, float* __restrict acc, int64_t acc_stride) {
  for (int c = 0; c < D; c += 8 * CB) {
    __m256 a[NG][CB];
    for (int j = 0; j < NG; ++j)
      for (int cc = 0; cc < CB; ++cc) a[j][cc] = _mm256_loadu_ps(acc + j * acc_stride + c + 8 * cc);
    for (int64_t t = 0; t < ntok; ++t) {
      __m256 vv[CB];
      for (int cc = 0; cc < CB; ++cc) vv[cc] = _mm256_loadu_ps(v + t * D + c + 8 * cc);
      for (int j = 0; j < NG; ++j) {
        const __m256 pj = _mm256_broadcast_ss(p + j * p_stride + t);
        for (int cc = 0; cc < CB; ++cc) a[j][cc] = _mm256_fmadd_ps(pj, vv[cc], a[j][cc]);
      }
    }
    for (int j = 0; j < NG; ++j)
      for (int cc = 0; cc < CB; ++cc) _mm256_storeu_ps(acc + j * acc_stride + c + 8 * cc, a[j][cc]);
  }
}

template <int D>
RKV_INLINE void accumulate_tile(const float* __restrict v, int64_t ntok, const float* __restrict p, int64_t groups,
                                int64_t p_stride, float* __restrict acc, int64_t acc_stride) {
  constexpr int kCB = D % 16 == 0 ? 2 : 1;
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4)
    accumulate_tile_heads<D, 4, kCB>(v, ntok, p + g * p_stride, p_stride, acc + g * acc_stride, acc_stride);
  switch (groups - g) {
    case 3: accumulate_tile_heads<D, 3, kCB>(v, ntok, p + g * p_stride, p_stride, acc + g * acc_stride, acc_stride); break;
    case 2: accumulate_tile_heads<D, 2, kCB>(v, ntok, p + g * p_stride, p_stride, acc + g * acc_stride, acc_stride); break;
    case 1: accumulate_tile_heads<D, 1, kCB>(v, ntok, p + g * p_stride, p_stride, acc + g * acc_stride, acc_stride); break;
    default: break;
  }
}

// The packed word holding codes 8c..8c+7 of a row: the chunk's BITS bytes read little-endian (the
// docs/format.md bitstream; BITS < 8).
template <int BITS>
RKV_INLINE uint32_t chunk_word(const uint8_t* row, int64_t c, bool last) {
  // never read past the row (a wider load would run past the buffer at its last row). 3-bit chunks
  // borrow the next byte when it is in the row; the last one reads the 4 bytes ending with it and drops
  // the first (a 3-byte read would be assembled on the stack, and the wider reload stalls on store
  // forwarding)
  uint32_t w = 0;
  if constexpr (BITS == 2) {
    uint16_t h;
    std::memcpy(&h, row + 2 * c, 2);
    w = h;
  } else if (BITS == 3 && last && c > 0) {
    std::memcpy(&w, row + BITS * c - 1, 4);
    w >>= 8;
  } else if (BITS == 3 && last) {
    std::memcpy(&w, row, 3);  // a row of one chunk (head_dim 8)
  } else {
    std::memcpy(&w, row + BITS * c, 4);
  }
  return w;
}

// Codes 8c..8c+7 of a packed row as 8 ints: the chunk's word broadcast, shifted right by 0, b, ..., 7b
// per lane and masked.
template <int BITS>
RKV_INLINE __m256i code_ints(const uint8_t* row, int64_t c, bool last) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 8 * c)));
  } else {
    const __m256i shifts = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS);
    return _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(chunk_word<BITS>(row, c, last))),
                                              shifts),
                            _mm256_set1_epi32((1 << BITS) - 1));
  }
}

// How codes become code values (include/rkv/quant.h): the uniform grid converts them (LUT false);
// non-uniform levels (2, 3 or 4 bits) are looked up in registers, one permute for up to 8 levels, two and
// a blend on bit 3 for 16, so a codebook costs the fused kernels a few instructions per 8 codes.
template <int BITS, bool LUT>
struct CodeValues {
  __m256 lo, hi;
  CodeValues() = default;
  explicit CodeValues(const float* lut) {
    if constexpr (LUT) {
      alignas(32) float t[16] = {};
      for (int i = 0; i < (1 << BITS); ++i) t[i] = lut[i];
      lo = _mm256_load_ps(t);
      hi = _mm256_load_ps(t + 8);
    }
  }
  // codes 8c..8c+7 of a packed row as their 8 code values
  RKV_INLINE __m256 chunk(const uint8_t* row, int64_t c, bool last) const {
    if constexpr (LUT && BITS == 4) {
      // each code shifted to the top nibble of its lane: bit 3 is the lane's sign, which blendv reads, and
      // one more shift leaves the code itself for the permutes (which read its low 3 bits)
      const __m256i top = _mm256_sllv_epi32(_mm256_set1_epi32(static_cast<int>(chunk_word<4>(row, c, last))),
                                            _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
      const __m256i v = _mm256_srli_epi32(top, 28);
      return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, v), _mm256_permutevar8x32_ps(hi, v),
                              _mm256_castsi256_ps(top));
    } else {
      const __m256i v = code_ints<BITS>(row, c, last);
      if constexpr (LUT) return _mm256_permutevar8x32_ps(lo, v);
      else return _mm256_cvtepi32_ps(v);
    }
  }
};

// f(CodeValues<bits, levels != nullptr>): the per-row loops are compiled once per width and kind of
// levels, chosen once per tile, not per row. 8-bit codes are uniform only.
template <typename F>
RKV_INLINE void with_code_values(int bits, const float* levels, F&& f) {
  if (levels != nullptr) {
    switch (bits) {
      case 2: return f(CodeValues<2, true>(levels));
      case 3: return f(CodeValues<3, true>(levels));
      default: return f(CodeValues<4, true>(levels));
    }
  }
  switch (bits) {
    case 2: return f(CodeValues<2, false>());
    case 3: return f(CodeValues<3, false>());
    case 4: return f(CodeValues<4, false>());
    default: return f(CodeValues<8, false>());
  }
}

// out[c] = value(code_c) * sc + zc with per-channel (group == 1) or per-group (group % 8 == 0)
// parameters; symmetric quantization passes zc = -2^(bits-1) * sc. Rounds once (FMA): attention-grade,
// not the bit-exact rkv.dequantize path.
template <int D, typename CV>
RKV_INLINE void decode_row_chunks(const CV& cv, const uint8_t* __restrict row, const float* __restrict sc,
                                  const float* __restrict zc, int64_t group, float* __restrict out) {
  constexpr int64_t kChunks = D / 8;
  if (group == 1) {
    for (int64_t c = 0; c < kChunks; ++c)
      _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(cv.chunk(row, c, c == kChunks - 1), _mm256_loadu_ps(sc + 8 * c),
                                                    _mm256_loadu_ps(zc + 8 * c)));
    return;
  }
  const int64_t per_group = group / 8;
  for (int64_t gi = 0, c = 0; gi < D / group; ++gi) {
    const __m256 s = _mm256_set1_ps(sc[gi]), z = _mm256_set1_ps(zc[gi]);
    for (int64_t j = 0; j < per_group; ++j, ++c)
      _mm256_storeu_ps(out + 8 * c, _mm256_fmadd_ps(cv.chunk(row, c, c == kChunks - 1), s, z));
  }
}

// decode_row_chunks (per-channel parameters: the layout of pre-RoPE keys) followed by rotate-half RoPE
// of the first 2 * half channels, in registers: one pass over the row instead of a decode pass and a
// RoPE pass. Each rotated channel is one product and one FMA (x0 c - x1 s, x1 c + x0 s): within one
// rounding of rope_apply's two products and a sum. half must be a multiple of 8; HC = half / 8 when
// it is a compile-time constant (full rotary: the loop unrolls, cos / sin stay out of the stack), 0
// otherwise.
template <int D, int HC, typename CV>
RKV_INLINE void decode_rope_row_chunks(const CV& cv, const uint8_t* __restrict row, const float* __restrict sc,
                                       const float* __restrict zc, const float* __restrict cs,
                                       const float* __restrict sn, int64_t half, float* __restrict out) {
  constexpr int64_t kChunks = D / 8;
  const auto chunk = [&](int64_t c) {  // code * s + z, one FMA as decode_row_chunks
    return _mm256_fmadd_ps(cv.chunk(row, c, c == kChunks - 1), _mm256_loadu_ps(sc + 8 * c),
                           _mm256_loadu_ps(zc + 8 * c));
  };
  const int64_t hc = HC > 0 ? HC : half / 8;
  for (int64_t j = 0; j < hc; ++j) {
    const __m256 x0 = chunk(j), x1 = chunk(j + hc);
    const __m256 c = _mm256_loadu_ps(cs + 8 * j), s = _mm256_loadu_ps(sn + 8 * j);
    _mm256_storeu_ps(out + 8 * j, _mm256_fmsub_ps(x0, c, _mm256_mul_ps(x1, s)));
    _mm256_storeu_ps(out + 8 * (j + hc), _mm256_fmadd_ps(x1, c, _mm256_mul_ps(x0, s)));
  }
  for (int64_t c = 2 * hc; c < kChunks; ++c) _mm256_storeu_ps(out + 8 * c, chunk(c));
}

// Values stored per token (scale s_tg and zero z_tg per row and group) fold their dequantization into
// the probabilities: sum_t p_t (s_tg c_t + z_tg) = sum_t (p_t s_tg) c_t + (sum_t p_t z_tg) 1. The codes
// go straight from the packed rows into the output accumulators, no float tile in between: per 8 codes
// one load, shift, mask and convert, then one FMA per query head.
//
// The folded probabilities p_t s_tg of head j, for the group of 8-channel chunk c, row t:
struct FoldedProbs {
  const float* p;
  int64_t head_stride, group_chunks, group_stride;  // group_chunks: chunks per group (D / 8 for one)
  RKV_INLINE const float* at(int64_t j, int64_t c) const {
    return p + j * head_stride + (c / group_chunks) * group_stride;
  }
};

// acc[j][:] += pp(j, chunk)[t] * codes_t for NG heads, CB chunks of 8 channels per pass, all in one
// group (accumulators in registers: NG x CB of them, plus NG broadcasts).
template <int D, int NG, int CB, typename CV>
RKV_INLINE void accumulate_codes_heads(const CV& cv, const uint8_t* __restrict rows, int64_t row_bytes, int64_t ntok,
                                       const FoldedProbs& pp, float* __restrict acc, int64_t acc_stride) {
  constexpr int kChunks = D / 8;
  static_assert(kChunks % CB == 0, "passes must tile the row");
  for (int c0 = 0; c0 < kChunks; c0 += CB) {
    const float* pj[NG];
    for (int j = 0; j < NG; ++j) pj[j] = pp.at(j, c0);
    __m256 a[NG][CB];
    for (int j = 0; j < NG; ++j)
      for (int cc = 0; cc < CB; ++cc) a[j][cc] = _mm256_loadu_ps(acc + j * acc_stride + 8 * (c0 + cc));
    for (int64_t t = 0; t < ntok; ++t) {
      const uint8_t* row = rows + t * row_bytes;
      __m256 p[NG];
      for (int j = 0; j < NG; ++j) p[j] = _mm256_broadcast_ss(pj[j] + t);
      for (int cc = 0; cc < CB; ++cc) {
        const __m256 v = cv.chunk(row, c0 + cc, c0 + cc == kChunks - 1);
        for (int j = 0; j < NG; ++j) a[j][cc] = _mm256_fmadd_ps(p[j], v, a[j][cc]);
      }
    }
    for (int j = 0; j < NG; ++j)
      for (int cc = 0; cc < CB; ++cc) _mm256_storeu_ps(acc + j * acc_stride + 8 * (c0 + cc), a[j][cc]);
  }
}

template <int D, typename CV>
RKV_INLINE void accumulate_codes_bits(const CV& cv, const uint8_t* rows, int64_t row_bytes, int64_t ntok, FoldedProbs pp,
                                      int64_t groups, float* acc, int64_t acc_stride) {
  constexpr int kWide = (D / 8) % 4 == 0 ? 4 : 1;  // chunks per pass for 1-2 heads
  constexpr int kNarrow = (D / 8) % 2 == 0 ? 2 : 1;  // for 3-4 heads: 6-8 accumulators, no spills
  int64_t g = 0;
  for (; g + 4 <= groups; g += 4, pp.p += 4 * pp.head_stride)
    accumulate_codes_heads<D, 4, kNarrow>(cv, rows, row_bytes, ntok, pp, acc + g * acc_stride, acc_stride);
  float* a = acc + g * acc_stride;
  switch (groups - g) {
    case 3: accumulate_codes_heads<D, 3, kNarrow>(cv, rows, row_bytes, ntok, pp, a, acc_stride); break;
    case 2: accumulate_codes_heads<D, 2, kWide>(cv, rows, row_bytes, ntok, pp, a, acc_stride); break;
    case 1: accumulate_codes_heads<D, 1, kWide>(cv, rows, row_bytes, ntok, pp, a, acc_stride); break;
    default: break;
  }
}

// acc[g][:] += pp(g, chunk)[t] * values of packed row t's codes, for t < ntok and every query head g of
// the GQA group. Value groups must be a multiple of 32 channels (or the whole row): a pass never leaves one.
template <int D>
RKV_INLINE void accumulate_codes(const uint8_t* rows, int64_t row_bytes, int bits, const float* levels, int64_t ntok,
                                 const FoldedProbs& pp, int64_t groups, float* acc, int64_t acc_stride) {
  with_code_values(bits, levels, [&](const auto& cv) {
    accumulate_codes_bits<D>(cv, rows, row_bytes, ntok, pp, groups, acc, acc_stride);
  });
}

// s[i] <- exp(s[i] - m) for i < n, returns their sum: softmax_exp (include/rkv/attention.h), 8 lanes at a time.
RKV_INLINE float exp_sum_row(float* __restrict s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m), lo = _mm256_set1_ps(-87.0f), log2e = _mm256_set1_ps(1.44269504088896341f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693145751953125f), ln2_lo = _mm256_set1_ps(1.428606765330187e-6f);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    // max_ps returns its second operand when either is NaN: NaN scores stay NaN, as in softmax_exp
    __m256 x = _mm256_max_ps(lo, _mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(k, ln2_hi)), _mm256_mul_ps(k, ln2_lo));
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
    _mm256_storeu_ps(s + i, y);
    sum = _mm256_add_ps(sum, y);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; i < n; ++i) {
    s[i] = softmax_exp(s[i] - m);
    total += s[i];
  }
  return total;
}

#else  // portable

RKV_INLINE float exp_sum_row(float* __restrict s, int64_t n, float m) {
  float total = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    s[i] = softmax_exp(s[i] - m);
    total += s[i];
  }
  return total;
}

#endif  // RKV_TILES_AVX2

// Portable versions (any D, any ISA); also the path for head dims that are not multiples of 8.
RKV_INLINE void scores_tile_generic(const float* __restrict k, int64_t ntok, int64_t dim, const float* __restrict q,
                                    int64_t groups, float* __restrict s, int64_t s_stride) {
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < ntok; ++t) {
      const float* kt = k + t * dim;
      const float* qg = q + g * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < dim; ++c) dot += qg[c] * kt[c];
      s[g * s_stride + t] = dot;
    }
}

RKV_INLINE void accumulate_tile_generic(const float* __restrict v, int64_t ntok, int64_t dim, const float* __restrict p,
                                        int64_t groups, int64_t p_stride, float* __restrict acc, int64_t acc_stride) {
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t t = 0; t < ntok; ++t) {
      const float pt = p[g * p_stride + t];
      const float* vt = v + t * dim;
      float* a = acc + g * acc_stride;
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) a[c] = fma_f(pt, vt[c], a[c]);
    }
}

}  // namespace RKV_CPU_ISA
}  // namespace rkv::cpu
