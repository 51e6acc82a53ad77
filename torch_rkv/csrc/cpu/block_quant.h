// CPU quantization of one block-row: block_tokens token rows x dim channels, one (scale, zero) per
// group of group_size channels. Used by rkv::quantize and by the cache append, so a block quantized
// when a cache fills it is bit-identical to quantizing the same tokens with rkv::quantize.
#pragma once

#include <cstring>
#include <vector>

#include "capability.h"
#include "convert.h"
#include "rkv/pack.h"
#include "rkv/quant.h"

namespace rkv::cpu {
inline namespace RKV_CPU_ISA {

// Fast whole-row pack for the CPU; same bytes as pack_byte (the layout spec) for every width.
inline void pack_row(const uint8_t* __restrict codes, int64_t dim, int bits, uint8_t* __restrict out) {
  switch (bits) {
    case 8:
      std::memcpy(out, codes, dim);
      break;
    case 4:
#pragma omp simd
      for (int64_t k = 0; k < dim / 2; ++k) out[k] = static_cast<uint8_t>(codes[2 * k] | (codes[2 * k + 1] << 4));
      break;
    case 2:
#pragma omp simd
      for (int64_t k = 0; k < dim / 4; ++k)
        out[k] = static_cast<uint8_t>(codes[4 * k] | (codes[4 * k + 1] << 2) | (codes[4 * k + 2] << 4) |
                                      (codes[4 * k + 3] << 6));
      break;
    default:  // 3 bits: 8 codes -> 3 bytes
      for (int64_t w = 0; w < dim / 8; ++w) {
        const uint8_t* c = codes + 8 * w;
        uint32_t v = 0;
        for (int j = 0; j < 8; ++j) v |= static_cast<uint32_t>(c[j]) << (3 * j);
        out[3 * w] = static_cast<uint8_t>(v);
        out[3 * w + 1] = static_cast<uint8_t>(v >> 8);
        out[3 * w + 2] = static_cast<uint8_t>(v >> 16);
      }
  }
}

// Fast whole-row unpack; same codes as unpack_code.
RKV_INLINE void unpack_row(const uint8_t* __restrict row, int64_t dim, int bits, uint8_t* __restrict codes) {
  switch (bits) {
    case 8:
      std::memcpy(codes, row, dim);
      break;
    case 4:
#pragma omp simd
      for (int64_t k = 0; k < dim / 2; ++k) {
        codes[2 * k] = row[k] & 0xf;
        codes[2 * k + 1] = row[k] >> 4;
      }
      break;
    case 2:
#pragma omp simd
      for (int64_t k = 0; k < dim / 4; ++k) {
        codes[4 * k] = row[k] & 3;
        codes[4 * k + 1] = (row[k] >> 2) & 3;
        codes[4 * k + 2] = (row[k] >> 4) & 3;
        codes[4 * k + 3] = row[k] >> 6;
      }
      break;
    default:
      for (int64_t w = 0; w < dim / 8; ++w) {
        const uint32_t v = row[3 * w] | (row[3 * w + 1] << 8) | (row[3 * w + 2] << 16);
        for (int j = 0; j < 8; ++j) codes[8 * w + j] = (v >> (3 * j)) & 7;
      }
  }
}

// Per-thread scratch for quantize_block_row.
struct BlockScratch {
  std::vector<float> x, lo, hi, scale, zero;
  std::vector<uint8_t> codes;
  BlockScratch(int64_t block_tokens, int64_t groups, int64_t dim)
      : x(block_tokens * dim), lo(groups), hi(groups), scale(groups), zero(groups), codes(dim) {}
};

// src_row(t) -> const scalar_t* (dim values of token t of the block); dst_row(t) -> uint8_t* (its
// packed row). Writes groups = dim / group_size scales (and zeros unless symmetric). The first
// sink_rows rows (a cache's attention sinks, kept in full precision elsewhere) are encoded but do not
// set the ranges, unless every row is one (reference.quantize's sink_rows). lut: the side's
// non-uniform levels (include/rkv/quant.h), or nullptr. excluded (block_tokens x dim flags, or nullptr):
// values kept as sparse outliers (include/rkv/outliers.h), encoded but left out of every range. unclipped
// (groups flags, or nullptr): groups that keep their full range under clip (refined key channels).
template <typename scalar_t, typename meta_t, typename SrcRow, typename DstRow>
void quantize_block_row(SrcRow src_row, DstRow dst_row, int64_t block_tokens, int64_t dim, int64_t group_size,
                        int bits, bool symmetric, bool clip, meta_t* scale_out, meta_t* zero_out,
                        BlockScratch& s, int64_t sink_rows = 0, const float* lut = nullptr,
                        const uint8_t* excluded = nullptr, const uint8_t* unclipped = nullptr) {
  const int64_t groups = dim / group_size, counted0 = sink_rows < block_tokens ? sink_rows : 0;
  float* xs = s.x.data();
  for (int64_t t = 0; t < block_tokens; ++t) to_float(src_row(t), xs + t * dim, dim);
  float* lo = s.lo.data();
  float* hi = s.hi.data();
  for (int64_t gi = 0; gi < groups; ++gi) {
    lo[gi] = INFINITY;
    hi[gi] = -INFINITY;
  }
  // 1. min / max of the finite values of each tile.
  for (int64_t t = counted0; t < block_tokens; ++t) {
    const float* x = xs + t * dim;
    const uint8_t* ex = excluded != nullptr ? excluded + t * dim : nullptr;
    if (group_size == 1) {
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c) {
        const float v = x[c];
        const bool fin = is_finite(v) && !(ex != nullptr && ex[c]);
        lo[c] = (fin && v < lo[c]) ? v : lo[c];
        hi[c] = (fin && v > hi[c]) ? v : hi[c];
      }
    } else {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const float* xg = x + gi * group_size;
        const uint8_t* eg = ex != nullptr ? ex + gi * group_size : nullptr;
        float l = lo[gi], h = hi[gi];
#pragma omp simd reduction(min : l) reduction(max : h)
        for (int64_t c = 0; c < group_size; ++c) {
          const float v = xg[c];
          const bool fin = is_finite(v) && !(eg != nullptr && eg[c]);
          l = (fin && v < l) ? v : l;
          h = (fin && v > h) ? v : h;
        }
        lo[gi] = l;
        hi[gi] = h;
      }
    }
  }
  // 2. group parameters, stored in the metadata dtype (exactly representable by construction).
  for (int64_t gi = 0; gi < groups; ++gi) {
    const auto group_error = [&](QParams p) {  // the tile's elements in (token, channel) order
      double e = 0.0;
      for (int64_t t = counted0; t < block_tokens; ++t) {
        const float* xg = xs + t * dim + gi * group_size;
        const uint8_t* eg = excluded != nullptr ? excluded + t * dim + gi * group_size : nullptr;
        for (int64_t c = 0; c < group_size; ++c)
          if (eg == nullptr || !eg[c]) e += clip_error(xg[c], p, bits, lut);
      }
      return e;
    };
    const QParams p = clip && !(unclipped != nullptr && unclipped[gi])
                          ? clipped_qparams<meta_t>(lo[gi], hi[gi], bits, group_error)
                           : make_qparams<meta_t>(lo[gi], hi[gi], bits, symmetric);
    s.scale[gi] = p.scale;
    s.zero[gi] = p.zero;
    scale_out[gi] = static_cast<meta_t>(p.scale);
    if (!symmetric) zero_out[gi] = static_cast<meta_t>(p.zero);
  }
  // 3. codes, one packed row per token.
  uint8_t* codes = s.codes.data();
  const float* sc = s.scale.data();
  const float* zp = s.zero.data();
  for (int64_t t = 0; t < block_tokens; ++t) {
    const float* x = xs + t * dim;
    if (group_size == 1) {
#pragma omp simd
      for (int64_t c = 0; c < dim; ++c)
        codes[c] = static_cast<uint8_t>(encode(x[c], QParams{sc[c], zp[c]}, bits, symmetric, lut));
    } else {
      for (int64_t gi = 0; gi < groups; ++gi) {
        const QParams p{sc[gi], zp[gi]};
        const float* xg = x + gi * group_size;
        uint8_t* cg = codes + gi * group_size;
#pragma omp simd
        for (int64_t c = 0; c < group_size; ++c) cg[c] = static_cast<uint8_t>(encode(xg[c], p, bits, symmetric, lut));
      }
    }
    pack_row(codes, dim, bits, dst_row(t));
  }
}

// Decodes one packed row of dim codes whose group parameters (one per group_size channels) are the
// float arrays sc / zc (zc unused when symmetric), through the levels lut (nullptr: uniform). codes is
// dim bytes of scratch.
RKV_INLINE void decode_row(const uint8_t* packed_row, const float* sc, const float* zc, int64_t dim, int64_t group_size,
                           int bits, bool symmetric, const float* lut, uint8_t* __restrict codes,
                           float* __restrict out) {
  unpack_row(packed_row, dim, bits, codes);
  if (group_size == 1) {
#pragma omp simd
    for (int64_t c = 0; c < dim; ++c) out[c] = decode(codes[c], QParams{sc[c], symmetric ? 0.0f : zc[c]}, bits, symmetric, lut);
    return;
  }
  for (int64_t gi = 0; gi < dim / group_size; ++gi) {
    const QParams p{sc[gi], symmetric ? 0.0f : zc[gi]};
    const uint8_t* cg = codes + gi * group_size;
    float* og = out + gi * group_size;
#pragma omp simd
    for (int64_t c = 0; c < group_size; ++c) og[c] = decode(cg[c], p, bits, symmetric, lut);
  }
}

// Dequantizes one block-row: block_tokens packed rows sharing groups = dim / group_size parameters.
// dst_row(t) -> out_t* of token t. zero == nullptr: symmetric.
template <typename out_t, typename meta_t, typename DstRow>
void dequantize_block_row(const uint8_t* packed, const meta_t* scale, const meta_t* zero, DstRow dst_row,
                          int64_t block_tokens, int64_t dim, int64_t group_size, int bits, BlockScratch& s,
                          const float* lut = nullptr) {
  const int64_t groups = dim / group_size;
  const bool symmetric = zero == nullptr;
  to_float(scale, s.scale.data(), groups);
  if (!symmetric) to_float(zero, s.zero.data(), groups);
  const int64_t row_bytes = dim * bits / 8;
  for (int64_t t = 0; t < block_tokens; ++t) {
    decode_row(packed + t * row_bytes, s.scale.data(), s.zero.data(), dim, group_size, bits, symmetric, lut,
               s.codes.data(), s.x.data());
    from_float(s.x.data(), dst_row(t), dim);
  }
}

}  // namespace RKV_CPU_ISA
}  // namespace rkv::cpu
