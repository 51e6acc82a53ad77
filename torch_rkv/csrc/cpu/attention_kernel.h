// The CPU decode-attention kernel (rkv::decode_attention), written once and compiled once per
// instruction set: cpu/attention_default.cpp (portable) and cpu/attention_avx2*.cpp (AVX2 + FMA + F16C,
// where attention_tiles.h's register-blocked tiles take over). cpu/attention.cpp runs it.
//
// Work items are (sequence, kv head, split of split_tokens tokens): each dequantizes its keys once for
// all the query heads of its GQA group, applies RoPE to pre-RoPE keys, and keeps a partial softmax
// (max, sum, un-normalized output) that the op merges afterwards.
#pragma once

#include <algorithm>
#include <cmath>

#include "attention_tiles.h"
#include "block_quant.h"
#include "capability.h"
#include "decode_kernel.h"
#include "rkv/attention.h"
#include "rkv/rope.h"

namespace rkv::cpu {
inline namespace RKV_CPU_ISA {

// n floats of kind k from element `offset` of src.
RKV_INLINE void read_floats(const void* src, FloatKind k, int64_t offset, float* dst, int64_t n) {
  switch (k) {
    case FloatKind::F32: return to_float(static_cast<const float*>(src) + offset, dst, n);
    case FloatKind::F16: return to_float(static_cast<const c10::Half*>(src) + offset, dst, n);
    case FloatKind::BF16: return to_float(static_cast<const c10::BFloat16*>(src) + offset, dst, n);
  }
}

// Float rows of one cached tensor (keys or values) of one (sequence, kv head).
template <int DC>
struct RowReader {
  const uint8_t* packed;  // (capacity, row_bytes) of this (sequence, head)
  const void* scale;      // the whole metadata buffer; this head's rows start at element meta0
  const void* zero;       // same, or nullptr (symmetric)
  const void* window;     // the whole window buffer; this head's rows start at element window0
  const void* sink;       // likewise, sink0
  int64_t meta0, window0, sink0;
  FloatKind fp, meta;
  int64_t dim, block_tokens, group, sinks, window_len, q_count;
  int bits;
  float* sc;       // scratch: the metadata row of the current block, scales (dim / group floats)
  float* zc;       // and zeros: code * sc + zc decodes a code (symmetric: zc = -2^(bits-1) sc)
  uint8_t* codes;  // scratch: one row of codes
  int64_t meta_lo = 0, meta_hi = 0;  // tokens [meta_lo, meta_hi) share the metadata row in sc / zc

  // whether tokens [t, t + n) are all packed rows (no sink or window row among them)
  bool all_packed(int64_t t, int64_t n) const { return t >= sinks && t + n <= sinks + q_count; }
  // The zeros that make code * s + z decode symmetric codes too (stored with a bias of 2^(bits-1)).
  RKV_INLINE void symmetric_zeros(const float* s, float* z, int64_t n) const {
    const float bias = -static_cast<float>(sym_bias(bits));
    for (int64_t i = 0; i < n; ++i) z[i] = bias * s[i];
  }
  // Metadata rows [r, r + n) (row r: block r) in float, (n, groups) row-major.
  RKV_INLINE void meta_rows(int64_t r, int64_t n, float* s, float* z) const {
    const int64_t ng = dim / group;
    read_floats(scale, meta, meta0 + r * ng, s, n * ng);
    if (zero != nullptr) {
      read_floats(zero, meta, meta0 + r * ng, z, n * ng);
    } else {
      symmetric_zeros(s, z, n * ng);
    }
  }
  // Scales and zeros of packed rows [t, t + n), for one row per block.
  RKV_INLINE void row_params(int64_t t, int64_t n, float* s, float* z) const { meta_rows(t - sinks, n, s, z); }
  const uint8_t* packed_row(int64_t t) const { return packed + (t - sinks) * (dim * bits / 8); }
  // Ask for packed rows [t, t + n) ahead of use: each split starts a fresh stream, which the hardware
  // prefetcher picks up only after a few misses.
  RKV_INLINE void prefetch(int64_t t, int64_t n) const {
    const int64_t lo = std::max(t, sinks), hi = std::min(t + n, sinks + q_count);
    if (lo >= hi) return;
    const char* p = reinterpret_cast<const char*>(packed_row(lo));
    const int64_t bytes = (hi - lo) * (dim * bits / 8);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
  // Metadata of packed token t's block in sc / zc.
  RKV_INLINE void load_meta(int64_t t) {
    if (t >= meta_lo && t < meta_hi) return;  // a compare per row, the division once per block
    const int64_t m = (t - sinks) / block_tokens;
    meta_rows(m, 1, sc, zc);
    meta_lo = sinks + m * block_tokens;
    meta_hi = meta_lo + block_tokens;
  }

#if RKV_TILES_AVX2
  // f(std::integral_constant<int, bits>): the per-row loops below are compiled once per bit width, so
  // the width is chosen once per tile, not per row.
  template <typename F>
  RKV_INLINE void with_bits(F&& f) const {
    switch (bits) {
      case 2: return f(std::integral_constant<int, 2>{});
      case 3: return f(std::integral_constant<int, 3>{});
      case 4: return f(std::integral_constant<int, 4>{});
      default: return f(std::integral_constant<int, 8>{});
    }
  }
#endif

  // whether decode_row_chunks takes these rows (head_dim a multiple of 8 is the caller's condition)
  bool register_decode() const { return group == 1 || group % 8 == 0; }

  // Rows [t, t + n) into out (n x D), dequantized, where they are all packed and the register path
  // applies; false (nothing written) otherwise.
  RKV_INLINE bool load_tile(int64_t t, int64_t n, float* out) {
#if RKV_TILES_AVX2
    if constexpr (DC > 0 && DC % 8 == 0) {
      if (!all_packed(t, n) || !register_decode()) return false;
      with_bits([&](auto b) {
        for (int64_t i = 0; i < n; ++i) {
          load_meta(t + i);
          decode_row_chunks<DC, decltype(b)::value>(packed_row(t + i), sc, zc, group, out + i * DC);
        }
      });
      return true;
    }
#endif
    return false;
  }

  // Rows [t, t + n) dequantized and rotated (rotate-half RoPE of the first 2 * half channels; cs / sn:
  // the cos / sin rows of position t, half apart) in one pass, where they are all packed per-channel
  // keys and half is a multiple of 8; false (nothing written) otherwise. Within one rounding of load
  // + rope_row (it fuses a product into each sum).
  RKV_INLINE bool load_rope_tile(int64_t t, int64_t n, float* out, const float* cs, const float* sn, int64_t half) {
#if RKV_TILES_AVX2
    if constexpr (DC > 0 && DC % 8 == 0) {
      if (!all_packed(t, n) || group != 1 || half % 8 != 0) return false;
      with_bits([&](auto b) {
        constexpr int kBits = decltype(b)::value;
        const auto rows = [&](auto hc) {  // hc: half / 8 as a constant (full rotary), or 0: runtime
          for (int64_t i = 0; i < n; ++i) {
            load_meta(t + i);
            decode_rope_row_chunks<DC, kBits, decltype(hc)::value>(packed_row(t + i), sc, zc, cs + i * half,
                                                                   sn + i * half, half, out + i * DC);
          }
        };
        if (2 * half == DC) return rows(std::integral_constant<int, DC / 16>{});
        rows(std::integral_constant<int, 0>{});
      });
      return true;
    }
#endif
    return false;
  }

  RKV_INLINE void load(int64_t t, float* out) {
    const int64_t dim = DC > 0 ? DC : this->dim;
    switch (token_place(t, sinks, q_count)) {
      case Place::Sink:
        read_floats(sink, fp, sink0 + t * dim, out, dim);
        return;
      case Place::Window:
        read_floats(window, fp, window0 + window_slot(t, sinks, window_len) * dim, out, dim);
        return;
      case Place::Packed: {
        load_meta(t);
        const uint8_t* row = packed_row(t);
#if RKV_TILES_AVX2
        if constexpr (DC > 0 && DC % 8 == 0) {
          if (register_decode()) {
            with_bits([&](auto b) { decode_row_chunks<DC, decltype(b)::value>(row, sc, zc, group, out); });
            return;
          }
        }
#endif
        decode_row(row, sc, zc, dim, group, bits, zero == nullptr, codes, out);
        return;
      }
    }
  }
};

RKV_INLINE void rope_row(float* __restrict k, const float* __restrict c, const float* __restrict s, int64_t half,
                         bool interleaved) {
  if (interleaved) {
    for (int64_t j = 0; j < half; ++j) rope_apply(k[2 * j], k[2 * j + 1], c[j], s[j]);
  } else {
    float* __restrict k1 = k + half;
#pragma omp simd
    for (int64_t j = 0; j < half; ++j) rope_apply(k[j], k1[j], c[j], s[j]);
  }
}

// Tile micro-kernels: register-blocked AVX2 for head dims that are multiples of 8, portable otherwise.
template <int DC>
RKV_INLINE void tile_scores(const float* k, int64_t ntok, int64_t dim, const float* q, int64_t groups, float* s,
                            int64_t s_stride) {
#if RKV_TILES_AVX2
  if constexpr (DC > 0 && DC % 8 == 0) return scores_tile<DC>(k, ntok, q, groups, s, s_stride);
#endif
  scores_tile_generic(k, ntok, dim, q, groups, s, s_stride);
}

template <int DC>
RKV_INLINE void tile_accumulate(const float* v, int64_t ntok, int64_t dim, const float* p, int64_t groups,
                                int64_t p_stride, float* acc, int64_t acc_stride) {
#if RKV_TILES_AVX2
  if constexpr (DC > 0 && DC % 8 == 0) return accumulate_tile<DC>(v, ntok, p, groups, p_stride, acc, acc_stride);
#endif
  accumulate_tile_generic(v, ntok, dim, p, groups, p_stride, acc, acc_stride);
}

// Folded values of one tile of nt rows: pt[(g, vg)][i] = p[g][i] * s[i][vg] and zsum[(g, vg)] +=
// sum_i p[g][i] * z[i][vg], for the G query heads (p rows p_stride apart) and VG value groups.
RKV_INLINE void fold_probs(const float* __restrict p, int64_t p_stride, int64_t G, int64_t VG, int64_t nt,
                           const float* __restrict s, const float* __restrict z, float* __restrict pt,
                           float* __restrict zsum) {
  for (int64_t gq = 0; gq < G; ++gq) {
    const float* __restrict pg = p + gq * p_stride;
    for (int64_t vg = 0; vg < VG; ++vg) {
      float zs = 0.0f;
#pragma omp simd reduction(+ : zs)
      for (int64_t i = 0; i < nt; ++i) {
        pt[(gq * VG + vg) * kTileTokens + i] = pg[i] * s[i * VG + vg];
        zs += pg[i] * z[i * VG + vg];
      }
      zsum[gq * VG + vg] += zs;
    }
  }
}

template <int DC>
void decode_items(const DecodeArgs& a, int64_t begin, int64_t end, float* scratch) {
  const DecodeGeometry& g = a.g;
  const int64_t D = DC > 0 ? DC : g.dim, G = g.group_size(), ST = g.split_tokens, H = g.kv_heads;
  const ScratchLayout lay(g);
  float* const tile = scratch + lay.tile;
  float* const scores = scratch + lay.scores;
  uint8_t* const codes = reinterpret_cast<uint8_t*>(scratch + lay.codes);
  const auto reader = [&](bool keys, int64_t b, int64_t h, int64_t q_count) {
    const CachedSide& side = keys ? a.k : a.v;
    const int64_t bh = b * H + h, bits = keys ? g.k_bits : g.v_bits, group = keys ? g.k_group : g.v_group;
    const int64_t block_tokens = keys ? g.k_block_tokens : g.v_block_tokens, ng = D / group;
    float* meta = scratch + (keys ? lay.k_meta : lay.v_meta);
    return RowReader<DC>{side.packed + bh * g.capacity * (D * bits / 8),
                         side.scale, side.zero, side.window, side.sink,
                         bh * (g.capacity / block_tokens) * ng, bh * g.window * D, bh * g.sinks * D,
                         a.fp, a.meta, D, block_tokens, group, g.sinks, g.window, q_count, static_cast<int>(bits),
                         meta, meta + ng, codes};
  };

#if RKV_TILES_AVX2
  constexpr bool kFoldable = DC > 0 && DC % 8 == 0;
#else
  constexpr bool kFoldable = false;
#endif
  // values quantized per token (one row per block; one group per row, or groups of a multiple of 32
  // channels, which every register pass of accumulate_codes stays inside) take the folded path on
  // whole tiles of packed rows
  const bool fold_values = kFoldable && g.v_block_tokens == 1 && (g.v_group == D || g.v_group % 32 == 0);
  const int64_t VG = D / g.v_group;  // value groups per row
  float* const zsum = scratch + lay.zsum;
#if RKV_TILES_AVX2
  float* const pp = scratch + lay.folded;
  float* const sv = scratch + lay.scales;
  float* const zv = scratch + lay.zeros;
#endif
  std::fill(tile, tile + kTileTokens * D, 0.0f);  // rows past a partial tile stay readable zeros
  for (int64_t it = begin; it < end; ++it) {
    // kv heads vary fastest: the items of one split run together and share its cos / sin rows in cache
    const int64_t h = it % H, bs = it / H, split = bs % a.splits, b = bs / a.splits;
    const int64_t n = a.lengths[b], t0 = split * ST, t1 = std::min(n, t0 + ST);
    const int64_t hq0 = b * g.q_heads + h * G;  // first query head of this kv head
    float* ml = a.part_ml + (hq0 * a.splits + split) * 2;
    float* acc = a.part_acc + (hq0 * a.splits + split) * D;
    const int64_t ml_stride = a.splits * 2, acc_stride = a.splits * D;
    for (int64_t gq = 0; gq < G; ++gq) std::fill(acc + gq * acc_stride, acc + gq * acc_stride + D, 0.0f);
    if (t0 >= t1) {  // nothing cached in this split: an empty partial
      for (int64_t gq = 0; gq < G; ++gq) {
        ml[gq * ml_stride] = -INFINITY;
        ml[gq * ml_stride + 1] = 0.0f;
      }
      continue;
    }
    const int64_t q_count = quantized_count(n, g.sinks, g.recent, g.block), len = t1 - t0;
    // 1. scores = q . k for every query head of the group, a tile of keys at a time
    auto keys = reader(true, b, h, q_count);
    const float* qg = a.q + hq0 * D;
    for (int64_t tt = t0; tt < t1; tt += kTileTokens) {
      keys.prefetch(tt + 2 * kTileTokens, kTileTokens);
      const int64_t nt = std::min(kTileTokens, t1 - tt);
      if (!a.cos) {
        if (!keys.load_tile(tt, nt, tile))
          for (int64_t i = 0; i < nt; ++i) keys.load(tt + i, tile + i * D);
      } else {
        const float* cs = a.cos + tt * g.rope_half;
        const float* sn = a.sin + tt * g.rope_half;
        if (g.interleaved || !keys.load_rope_tile(tt, nt, tile, cs, sn, g.rope_half)) {
          for (int64_t i = 0; i < nt; ++i) {
            float* row = tile + i * D;
            keys.load(tt + i, row);
            rope_row(row, cs + i * g.rope_half, sn + i * g.rope_half, g.rope_half, g.interleaved);
          }
        }
      }
      tile_scores<DC>(tile, nt, D, qg, G, scores + (tt - t0), ST);
    }
    // 2. partial softmax per query head
    for (int64_t gq = 0; gq < G; ++gq) {
      float* s = scores + gq * ST;
      float m = -INFINITY;
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < len; ++i) m = s[i] > m ? s[i] : m;
      ml[gq * ml_stride] = m;
      ml[gq * ml_stride + 1] = exp_sum_row(s, len, m);
    }
    // 3. un-normalized output sum_t p_t v_t, a tile of values at a time
    auto values = reader(false, b, h, q_count);
    std::fill(zsum, zsum + G * VG, 0.0f);
    for (int64_t tt = t0; tt < t1; tt += kTileTokens) {
      values.prefetch(tt + 2 * kTileTokens, kTileTokens);
      const int64_t nt = std::min(kTileTokens, t1 - tt);
#if RKV_TILES_AVX2
      if constexpr (kFoldable) {
        if (fold_values && values.all_packed(tt, nt)) {
          values.row_params(tt, nt, sv, zv);
          fold_probs(scores + (tt - t0), ST, G, VG, nt, sv, zv, pp, zsum);
          accumulate_codes<DC>(values.packed_row(tt), D * values.bits / 8, values.bits, nt,
                               FoldedProbs{pp, VG * kTileTokens, g.v_group / 8, kTileTokens}, G, acc, acc_stride);
          continue;
        }
      }
#endif
      if (!values.load_tile(tt, nt, tile))
        for (int64_t i = 0; i < nt; ++i) values.load(tt + i, tile + i * D);
      tile_accumulate<DC>(tile, nt, D, scores + (tt - t0), G, ST, acc, acc_stride);
    }
    if (fold_values)
      for (int64_t gq = 0; gq < G; ++gq)
        for (int64_t c = 0; c < D; ++c) acc[gq * acc_stride + c] += zsum[gq * VG + c / g.v_group];
  }
}

// The kernel for head_dim `dim` among the head dims `Dims` (compile-time constants: fully unrolled row
// loops; 0 is the generic kernel for any other head dim), or nullptr.
template <int... Dims>
DecodeItems select_decode_items(int64_t dim) {
  DecodeItems out = nullptr;
  ((out = out == nullptr && (Dims == dim || Dims == 0) ? &decode_items<Dims> : out), ...);
  return out;
}

}  // namespace RKV_CPU_ISA
}  // namespace rkv::cpu
