// The CPU attention kernel (rkv::decode_attention, paged_decode_attention, paged_prefill_attention),
// written once and compiled once per instruction set: cpu/attention_default.cpp (portable) and
// cpu/attention_avx2*.cpp (AVX2 + FMA + F16C, where attention_tiles.h's register-blocked tiles take over).
// cpu/attention.cpp runs it.
//
// Work items are (sequence, block of query tokens, split of split_tokens keys, kv head): each
// dequantizes its keys once for all its query rows (the query heads of the GQA group, times the query
// tokens of a prefill block), applies RoPE to pre-RoPE keys, and keeps a partial softmax (max, sum,
// un-normalized output) per row that the op merges afterwards.
#pragma once

#include <algorithm>
#include <cmath>

#include "attention_tiles.h"
#include "block_quant.h"
#include "capability.h"
#include "decode_kernel.h"
#include "rkv/attention.h"
#include "rkv/outliers.h"
#include "rkv/paging.h"
#include "rkv/rope.h"

namespace rkv::cpu {
inline namespace RKV_CPU_ISA {

// n floats of kind k from element `offset` of src.
RKV_INLINE void read_floats(const void* src, FloatKind k, int64_t offset, float* dst, int64_t n) {
  switch (k) {
    case FloatKind::F32: return to_float(static_cast<const float*>(src) + offset, dst, n);
    case FloatKind::F16: return to_float(static_cast<const c10::Half*>(src) + offset, dst, n);
    case FloatKind::BF16: return to_float(static_cast<const c10::BFloat16*>(src) + offset, dst, n);
    case FloatKind::F8E4M3: return to_float(static_cast<const c10::Float8_e4m3fn*>(src) + offset, dst, n);
  }
}

// Float rows of one cached tensor (keys or values) of one (sequence, kv head): its quantized rows in
// the pages of its block table, its full-precision sinks and window in its side slot, and (prefill) the
// chunk's own new rows.
template <int DC>
struct RowReader {
  const CacheGeometry* g;
  const PageTable* pt;
  const SideView* side;
  const void* fresh;  // the new rows (T, Hkv, D) of this side, or nullptr (decode)
  int64_t b, h, slot, fresh0;  // fresh0: element offset of this (sequence, head)'s first new row
  FloatKind fp, meta;
  int64_t dim, block_tokens, group, sinks, q_count, cached, row_bytes;
  int bits;
  float* sc;       // scratch: the metadata row of the current block, scales (dim / group floats)
  float* zc;       // and zeros: code * sc + zc decodes a code (symmetric: zc = -2^(bits-1) sc)
  uint8_t* codes;  // scratch: one row of codes
  int64_t meta_lo = 0, meta_hi = 0;  // tokens [meta_lo, meta_hi) share the metadata row in sc / zc
  PageCursor page;                      // the page of the tokens read last
  const uint8_t* page_codes = nullptr;  // codes of this head's row 0 in that page
  int64_t page_meta = 0;                // element offset of its metadata row 0

  // whether tokens [t, t + n) are all quantized rows (no sink, window or new row among them)
  bool all_packed(int64_t t, int64_t n) const { return t >= sinks && t + n <= q_count; }
  // The page that holds token t: a block-table read per page, a compare per row.
  RKV_INLINE void seek(int64_t t) {
    if (!page.seek(*pt, b, t)) return;
    page_codes = side->codes + side->codes_offset(*g, page.page, h, 0);
    page_meta = side->meta_offset(*g, page.page, h, 0);
  }
  // The zeros that make code * s + z decode symmetric codes too (stored with a bias of 2^(bits-1)).
  RKV_INLINE void symmetric_zeros(const float* s, float* z, int64_t n) const {
    const float bias = -static_cast<float>(sym_bias(bits));
    for (int64_t i = 0; i < n; ++i) z[i] = bias * s[i];
  }
  // n metadata rows (n x groups floats) from element `offset`.
  RKV_INLINE void meta_rows(int64_t offset, int64_t n, float* s, float* z) const {
    const int64_t ng = dim / group;
    read_floats(side->scale, meta, offset, s, n * ng);
    if (side->zero != nullptr) {
      read_floats(side->zero, meta, offset, z, n * ng);
    } else {
      symmetric_zeros(s, z, n * ng);
    }
  }
  // Scales and zeros of quantized rows [t, t + n) of one page, for one row per block.
  RKV_INLINE void row_params(int64_t t, int64_t n, float* s, float* z) {
    seek(t);
    meta_rows(page_meta + page.row(t) * (dim / group), n, s, z);
  }
  RKV_INLINE const uint8_t* packed_row(int64_t t) {
    seek(t);
    return page_codes + page.row(t) * row_bytes;
  }
  // Ask for quantized rows [t, t + n) of one page ahead of use: each split starts a fresh stream, which
  // the hardware prefetcher picks up only after a few misses.
  RKV_INLINE void prefetch(int64_t t, int64_t n) {
    const int64_t lo = std::max(t, sinks), hi = std::min(t + n, q_count);
    if (lo >= hi) return;
    const char* p = reinterpret_cast<const char*>(packed_row(lo));
    const int64_t bytes = (std::min(hi, page.hi) - lo) * row_bytes;
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
  }
  // Metadata of quantized token t's block in sc / zc.
  RKV_INLINE void load_meta(int64_t t) {
    if (t >= meta_lo && t < meta_hi) return;  // a compare per row, the division once per block
    seek(t);
    const int64_t m = page.row(t) / block_tokens;
    meta_rows(page_meta + m * (dim / group), 1, sc, zc);
    meta_lo = page.lo + m * block_tokens;
    meta_hi = meta_lo + block_tokens;
  }

  // f(i, c, r) for each sparse outlier of quantized rows [t, t + n) (include/rkv/outliers.h): residual r
  // of channel c of row t + i, to add to its dequantized value. Entries are sorted by position, so each
  // block's scan starts at the rows' first (a tile reads a slice of its block) and stops past them.
  template <typename F>
  RKV_INLINE void for_outliers(int64_t t, int64_t n, F&& f) {
    if (side->outliers == nullptr) return;
    const int64_t hi = std::min(t + n, q_count);
    for (int64_t u = std::max(t, sinks); u < hi;) {
      seek(u);
      const int64_t row = page.row(u), first = u - row % g->block, end = std::min(hi, first + g->block);
      const uint32_t* e = side->outliers + side->outlier_offset(*g, page.page, h, row);
      const int64_t pos_lo = (u - first) * dim, pos_hi = (end - first) * dim;
      for (int64_t k = first_outlier(e, side->outlier_count, pos_lo); k < side->outlier_count; ++k) {
        const int64_t pos = outlier_pos(e[k]);
        if (pos >= pos_hi) break;
        f(first + pos / dim - t, pos % dim, outlier_residual(e[k]));
      }
      u = end;
    }
  }

  // f(i, c, r) for each refined key channel c of quantized rows [t, t + n) (reference.refined_rows):
  // residual r of row t + i, to add to its dequantized value.
  template <typename F>
  RKV_INLINE void for_refined(int64_t t, int64_t n, F&& f) {
    if (side->refine == nullptr) return;
    const int64_t hi = std::min(t + n, q_count), m = side->refine_count;
    const int32_t* ch = side->channels + h * m;
    uint8_t r[kMaxRefined];
    float s[kMaxRefined];
    for (int64_t u = std::max(t, sinks); u < hi; ++u) {
      seek(u);
      const int64_t row = page.row(u), meta_row = side->meta_offset(*g, page.page, h, row);
      unpack_row(side->refine + side->refine_offset(*g, page.page, h, row), m, side->refine_bits, r);
      for (int64_t j = 0; j < m; ++j) read_floats(side->scale, meta, meta_row + ch[j], s + j, 1);
      for (int64_t j = 0; j < m; ++j) f(u - t, ch[j], refine_residual(r[j], s[j], side->refine_bits));
    }
  }

#if RKV_TILES_AVX2
  // f(CodeValues<bits, levels>): the per-row loops below are compiled once per bit width and kind of
  // levels, so both are chosen once per tile, not per row.
  template <typename F>
  RKV_INLINE void with_codes(F&& f) const {
    with_code_values(bits, side->levels, f);
  }
#endif

  // whether decode_row_chunks takes these rows (head_dim a multiple of 8 is the caller's condition)
  bool register_decode() const { return group == 1 || group % 8 == 0; }

  // Rows [t, t + n) into out (n x D), dequantized, where they are all quantized and the register path
  // applies; false (nothing written) otherwise.
  RKV_INLINE bool load_tile(int64_t t, int64_t n, float* out) {
#if RKV_TILES_AVX2
    if constexpr (DC > 0 && DC % 8 == 0) {
      if (!all_packed(t, n) || !register_decode()) return false;
      with_codes([&](const auto& cv) {
        for (int64_t i = 0; i < n; ++i) {
          load_meta(t + i);
          decode_row_chunks<DC>(cv, packed_row(t + i), sc, zc, group, out + i * DC);
        }
      });
      return true;
    }
#endif
    return false;
  }

  // Rows [t, t + n) dequantized and rotated (rotate-half RoPE of the first 2 * half channels; cs / sn:
  // the cos / sin rows of position t, half apart) in one pass, where they are all quantized per-channel
  // keys and half is a multiple of 8; false (nothing written) otherwise. Within one rounding of load
  // + rope_row (it fuses a product into each sum).
  RKV_INLINE bool load_rope_tile(int64_t t, int64_t n, float* out, const float* cs, const float* sn, int64_t half) {
#if RKV_TILES_AVX2
    if constexpr (DC > 0 && DC % 8 == 0) {
      if (!all_packed(t, n) || group != 1 || half % 8 != 0) return false;
      with_codes([&](const auto& cv) {
        const auto rows = [&](auto hc) {  // hc: half / 8 as a constant (full rotary), or 0: runtime
          for (int64_t i = 0; i < n; ++i) {
            load_meta(t + i);
            decode_rope_row_chunks<DC, decltype(hc)::value>(cv, packed_row(t + i), sc, zc, cs + i * half,
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
    switch (token_place(t, sinks, q_count, cached)) {
      case Place::Sink:
        read_floats(side->sink, fp, sink_offset(*g, slot, h, t), out, dim);
        return;
      case Place::Window:
        read_floats(side->window, fp, window_offset(*g, slot, h, t), out, dim);
        return;
      case Place::Fresh:
        read_floats(fresh, fp, fresh0 + (t - cached) * g->kv_heads * dim, out, dim);
        return;
      case Place::Packed: {
        load_meta(t);
        const uint8_t* row = packed_row(t);
#if RKV_TILES_AVX2
        if constexpr (DC > 0 && DC % 8 == 0) {
          if (register_decode()) {
            with_codes([&](const auto& cv) { decode_row_chunks<DC>(cv, row, sc, zc, group, out); });
            return;
          }
        }
#endif
        decode_row(row, sc, zc, dim, group, bits, side->zero == nullptr, side->levels, codes, out);
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
void attention_items(const AttentionArgs& a, int64_t begin, int64_t end, float* scratch) {
  const CacheGeometry& g = a.g;
  const int64_t D = DC > 0 ? DC : g.dim, G = g.group_size(), ST = g.split_tokens, H = g.kv_heads;
  const ScratchLayout lay(a);
  float* const tile = scratch + lay.tile;
  float* const scores = scratch + lay.scores;
  float* const acc = scratch + lay.acc;
  float* const ml = scratch + lay.ml;
  uint8_t* const codes = reinterpret_cast<uint8_t*>(scratch + lay.codes);
  const auto reader = [&](bool keys, int64_t b, int64_t h, int64_t n, int64_t q_count) {
    const SideView& side = keys ? a.k : a.v;
    float* meta = scratch + (keys ? lay.k_meta : lay.v_meta);
    const int64_t fresh0 = a.q_start != nullptr ? (a.q_start[b] * H + h) * D : 0;
    return RowReader<DC>{&g, &a.pt, &side, keys ? a.k_fresh : a.v_fresh, b, h, a.pt.slot(b), fresh0, a.fp,
                         keys ? a.k_meta : a.v_meta,
                         D, side.block_tokens, side.group, g.sinks, q_count, n, side.row_bytes(g), side.bits,
                         meta, meta + D / side.group, codes};
  };

#if RKV_TILES_AVX2
  constexpr bool kFoldable = DC > 0 && DC % 8 == 0;
#else
  constexpr bool kFoldable = false;
#endif
  // values quantized per token (one row per block; one group per row, or groups of a multiple of 32
  // channels, which every register pass of accumulate_codes stays inside) take the folded path on
  // whole tiles of quantized rows, for the few rows of a decode step; the many rows of a prefill block
  // dequantize each tile once instead (the fold decodes the codes again for every 4 rows)
  const bool fold_values = kFoldable && g.v_block_tokens == 1 && (g.v_group == D || g.v_group % 32 == 0) &&
                           a.rows() <= 8;
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
    int64_t rest = it / H;
    const int64_t h = it % H, split = rest % a.splits;
    rest /= a.splits;
    const int64_t qb = rest % a.q_blocks, b = rest / a.q_blocks;
    const int64_t n = a.lengths[b];
    // query tokens [i0, i1) of this sequence; token i is query row q_row0 + i of the queries
    const int64_t m = a.q_start != nullptr ? a.q_start[b + 1] - a.q_start[b] : 1;
    const int64_t i0 = qb * a.q_block, i1 = std::min(m, i0 + a.q_block);
    if (i0 >= i1) continue;  // a shorter chunk than the longest: no query rows in this item
    const int64_t q_row0 = a.q_start != nullptr ? a.q_start[b] : b, rows = (i1 - i0) * G;
    // row r = (token i0 + r / G, query head r % G of this kv head) sees keys [window_start(end), end)
    const auto end_of = [&](int64_t r) { return a.q_start != nullptr ? n + i0 + r / G + 1 : n; };
    const int64_t t0 = split_base(n, a.q_start != nullptr, g.sliding_window) + split * ST;
    const int64_t t1 = std::min(end_of(rows - 1), t0 + ST);
    const auto out_row = [&](int64_t r) {  // query row r's row in the (query tokens, Hq) outputs
      return (q_row0 + i0 + r / G) * g.q_heads + h * G + r % G;
    };
    float* const qg = scratch + lay.queries;
    for (int64_t r = 0; r < rows; ++r) {
      const float* src = a.q + out_row(r) * D;
      std::copy(src, src + D, qg + r * D);
    }
    for (int64_t r = 0; r < rows; ++r) {
      ml[2 * r] = -INFINITY;
      ml[2 * r + 1] = 0.0f;
    }
    std::fill(acc, acc + rows * D, 0.0f);
    std::fill(zsum, zsum + rows * VG, 0.0f);
    const int64_t q_count = quantized_count(n, g.recent, g.block);
    auto keys = reader(true, b, h, n, q_count);
    auto values = reader(false, b, h, n, q_count);
    // the split's keys a chunk at a time, with an online softmax across chunks (flash attention): the
    // scores of one chunk live in scratch, whatever the split's length
    for (int64_t c0 = t0; c0 < t1; c0 += kChunkTokens) {
      const int64_t c1 = std::min(t1, c0 + kChunkTokens), len = c1 - c0;
      // tiles never cross a page: the rows of a tile are adjacent in memory
      const auto tile_len = [&](int64_t tt) { return std::min({kTileTokens, c1 - tt, g.page_size - tt % g.page_size}); };
      // 1. scores = q . k for every query row, a tile of keys at a time
      for (int64_t tt = c0; tt < c1;) {
        const int64_t nt = tile_len(tt);
        keys.prefetch(tt + 2 * kTileTokens, kTileTokens);
        if (!a.cos) {
          if (!keys.load_tile(tt, nt, tile))
            for (int64_t i = 0; i < nt; ++i) keys.load(tt + i, tile + i * D);
          const auto add = [&](int64_t i, int64_t c, float r) { tile[i * D + c] += r; };
          keys.for_outliers(tt, nt, add);
          keys.for_refined(tt, nt, add);
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
          const auto add = [&](int64_t i, int64_t c, float r) {
            rope_add(tile + i * D, c, r, cs + i * g.rope_half, sn + i * g.rope_half, g.rope_half, g.interleaved);
          };
          keys.for_outliers(tt, nt, add);
          keys.for_refined(tt, nt, add);
        }
        tile_scores<DC>(tile, nt, D, qg, rows, scores + (tt - c0), kChunkTokens);
        tt += nt;
      }
      // 2. per query row, over the keys it sees (the others weigh exactly 0): the new running max, the
      // earlier sums and outputs rescaled to it, and this chunk's probabilities
      for (int64_t r = 0; r < rows; ++r) {
        float* s = scores + r * kChunkTokens;
        const int64_t own = std::max<int64_t>(0, std::min(len, end_of(r) - c0));
        // keys before the row's window weigh exactly 0, like those after its end
        const int64_t first = std::min(own, std::max<int64_t>(0, window_start(end_of(r), g.sliding_window) - c0));
        std::fill(s, s + first, 0.0f);
        if (g.softcap > 0.0f)
          for (int64_t i = first; i < own; ++i) s[i] = softcap_score(s[i], g.softcap);
        float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
        for (int64_t i = first; i < own; ++i) mx = s[i] > mx ? s[i] : mx;
        const float m_old = ml[2 * r], m_new = mx > m_old ? mx : m_old;
        if (own == first || m_new == -INFINITY) {  // nothing seen yet (or only -inf scores: infinite keys weigh 0)
          std::fill(s, s + len, 0.0f);
          continue;
        }
        if (m_new != m_old && m_old != -INFINITY) {
          const float corr = softmax_exp(m_old - m_new);
          ml[2 * r + 1] *= corr;
          for (int64_t c = 0; c < D; ++c) acc[r * D + c] *= corr;
          for (int64_t j = 0; j < VG; ++j) zsum[r * VG + j] *= corr;
        }
        ml[2 * r] = m_new;
        ml[2 * r + 1] += exp_sum_row(s + first, own - first, m_new);
        std::fill(s + own, s + len, 0.0f);
      }
      // 3. un-normalized output += sum_t p_t v_t, a tile of values at a time
      for (int64_t tt = c0; tt < c1;) {
        const int64_t nt = tile_len(tt);
        values.prefetch(tt + 2 * kTileTokens, kTileTokens);
#if RKV_TILES_AVX2
        if constexpr (kFoldable) {
          if (fold_values && values.all_packed(tt, nt)) {
            values.row_params(tt, nt, sv, zv);
            fold_probs(scores + (tt - c0), kChunkTokens, rows, VG, nt, sv, zv, pp, zsum);
            accumulate_codes<DC>(values.packed_row(tt), values.row_bytes, values.bits, values.side->levels, nt,
                                 FoldedProbs{pp, VG * kTileTokens, g.v_group / 8, kTileTokens}, rows, acc, D);
            values.for_outliers(tt, nt, [&](int64_t i, int64_t c, float r) {
              for (int64_t row = 0; row < rows; ++row) acc[row * D + c] += scores[row * kChunkTokens + tt - c0 + i] * r;
            });
            tt += nt;
            continue;
          }
        }
#endif
        if (!values.load_tile(tt, nt, tile))
          for (int64_t i = 0; i < nt; ++i) values.load(tt + i, tile + i * D);
        values.for_outliers(tt, nt, [&](int64_t i, int64_t c, float r) { tile[i * D + c] += r; });
        tile_accumulate<DC>(tile, nt, D, scores + (tt - c0), rows, kChunkTokens, acc, D);
        tt += nt;
      }
    }
    // the split's result: a partial (max, sum, output) per row to merge, or, with one split, the output
    for (int64_t r = 0; r < rows; ++r) {
      float* ar = acc + r * D;
      if (fold_values)
        for (int64_t c = 0; c < D; ++c) ar[c] += zsum[r * VG + c / g.v_group];
      if (a.out != nullptr) {
        const float inv = softmax_normalizer(SoftmaxPartial{ml[2 * r], ml[2 * r + 1]}, a.sink_logit(out_row(r)));
        float* o = a.out + out_row(r) * D;
        for (int64_t c = 0; c < D; ++c) o[c] = ar[c] * inv;
      } else {
        const int64_t at = out_row(r) * a.splits + split;
        a.part_ml[at * 2] = ml[2 * r];
        a.part_ml[at * 2 + 1] = ml[2 * r + 1];
        std::copy(ar, ar + D, a.part_acc + at * D);
      }
    }
  }
}

// The kernel for head_dim `dim` among the head dims `Dims` (compile-time constants: fully unrolled row
// loops; 0 is the generic kernel for any other head dim), or nullptr.
template <int... Dims>
AttentionItems select_attention_items(int64_t dim) {
  AttentionItems out = nullptr;
  ((out = out == nullptr && (Dims == dim || Dims == 0) ? &attention_items<Dims> : out), ...);
  return out;
}

}  // namespace RKV_CPU_ISA
}  // namespace rkv::cpu
