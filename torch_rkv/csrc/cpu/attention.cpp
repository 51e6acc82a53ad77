// CPU kernel of rkv::decode_attention: one query token per sequence against the quantized cache.
//
// Work items are (sequence, kv head, split of split_tokens tokens): each dequantizes its keys once for
// all the query heads of its GQA group, applies RoPE to pre-RoPE keys, and keeps a partial softmax
// (max, sum, un-normalized output); a second pass merges the splits of each query head in split order,
// so the result does not depend on the thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "../dispatch.h"
#include "../op_common.h"
#include "attention_tiles.h"
#include "block_quant.h"
#include "rkv/attention.h"
#include "rkv/rope.h"

namespace rkv::cpu {
namespace {

// Float rows of one cached tensor (keys or values) of one (sequence, kv head).
template <typename fp_t, typename meta_t, int DC>
struct RowReader {
  const uint8_t* packed;  // (capacity, row_bytes)
  const meta_t* scale;    // (capacity / block_tokens, dim / group)
  const meta_t* zero;     // same, or nullptr (symmetric)
  const fp_t* window;     // (W, dim)
  const fp_t* sink;       // (S, dim)
  int64_t dim, block_tokens, group, sinks, window_len, q_count;
  int bits;
  // scratch: the current metadata row in float, and one row of codes
  std::vector<float> sc, zc;
  std::vector<uint8_t> codes;
  int64_t meta_lo = 0, meta_hi = 0;  // tokens [meta_lo, meta_hi) share the metadata row in sc / zc

  void init() {
    sc.resize(dim / group);
    zc.resize(dim / group);
    codes.resize(dim);
  }

  // whether tokens [t, t + n) are all packed rows (no sink or window row among them)
  bool all_packed(int64_t t, int64_t n) const { return t >= sinks && t + n <= sinks + q_count; }
  // Scales and zeros (symmetric: -2^(bits-1) * scale) of packed rows [t, t + n) in float, (n, groups)
  // row-major, for one row per block: there they are contiguous.
  RKV_INLINE void row_params(int64_t t, int64_t n, float* s, float* z) const {
    const int64_t ng = dim / group;
    to_float(scale + (t - sinks) * ng, s, n * ng);
    if (zero != nullptr) {
      to_float(zero + (t - sinks) * ng, z, n * ng);
    } else {
      symmetric_zeros(s, z, n * ng);
    }
  }
  // The zero that makes the fast decode code * s + z also hold for symmetric codes (stored with a
  // bias of 2^(bits-1)).
  RKV_INLINE void symmetric_zeros(const float* s, float* z, int64_t n) const {
    const float bias = -static_cast<float>(sym_bias(bits));
    for (int64_t i = 0; i < n; ++i) z[i] = bias * s[i];
  }
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
  // Metadata of packed token t's block in sc / zc (float; symmetric: zc = -2^(bits-1) sc on AVX2).
  RKV_INLINE void load_meta(int64_t t) {
    if (t >= meta_lo && t < meta_hi) return;  // a compare per row, the division once per block
    const int64_t m = (t - sinks) / block_tokens, ng = dim / group;
    const bool symmetric = zero == nullptr;
    to_float(scale + m * ng, sc.data(), ng);
    if (!symmetric) to_float(zero + m * ng, zc.data(), ng);
    meta_lo = sinks + m * block_tokens;
    meta_hi = meta_lo + block_tokens;
#if RKV_TILES_AVX2
    if (symmetric) symmetric_zeros(sc.data(), zc.data(), ng);
#endif
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
          decode_row_chunks<DC, decltype(b)::value>(packed_row(t + i), sc.data(), zc.data(), group, out + i * DC);
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
            decode_rope_row_chunks<DC, kBits, decltype(hc)::value>(packed_row(t + i), sc.data(), zc.data(),
                                                                   cs + i * half, sn + i * half, half, out + i * DC);
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
        to_float(sink + t * dim, out, dim);
        return;
      case Place::Window:
        to_float(window + window_slot(t, sinks, window_len) * dim, out, dim);
        return;
      case Place::Packed: {
        const bool symmetric = zero == nullptr;
        load_meta(t);
        const uint8_t* row = packed_row(t);
#if RKV_TILES_AVX2
        if constexpr (DC > 0 && DC % 8 == 0) {
          if (register_decode()) {
            with_bits([&](auto b) {
              decode_row_chunks<DC, decltype(b)::value>(row, sc.data(), zc.data(), group, out);
            });
            return;
          }
        }
#endif
        decode_row(row, sc.data(), zc.data(), dim, group, bits, symmetric, codes.data(), out);
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

struct Tensors {
  const float* q;        // (B, Hq, D): scaled (and rotated) queries
  const int64_t* lengths;
  const float* cos;      // (P, half) or nullptr
  const float* sin;
  float* part_ml;        // (B, Hq, splits, 2): max, sum
  float* part_acc;       // (B, Hq, splits, D)
  int64_t splits;
};

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

template <typename fp_t, typename meta_t, int DC>
void decode_kernel(const DecodeGeometry& g, const Tensors& io, const at::Tensor& k_packed, const at::Tensor& k_scale,
                   const at::Tensor& k_zero, const at::Tensor& v_packed, const at::Tensor& v_scale,
                   const at::Tensor& v_zero, const at::Tensor& k_window, const at::Tensor& v_window,
                   const at::Tensor& k_sink, const at::Tensor& v_sink) {
  const int64_t D = DC > 0 ? DC : g.dim, G = g.group_size(), ST = g.split_tokens, H = g.kv_heads;
  const int64_t items = g.batch * H * io.splits;
  const auto reader = [&](bool keys, int64_t b, int64_t h, int64_t q_count) {
    const at::Tensor& packed = keys ? k_packed : v_packed;
    const at::Tensor& scale = keys ? k_scale : v_scale;
    const at::Tensor& zero = keys ? k_zero : v_zero;
    const at::Tensor& window = keys ? k_window : v_window;
    const at::Tensor& sink = keys ? k_sink : v_sink;
    const int64_t bh = b * H + h, bits = keys ? g.k_bits : g.v_bits;
    const int64_t ng = scale.size(3), nb = scale.size(2);
    RowReader<fp_t, meta_t, DC> r{packed.const_data_ptr<uint8_t>() + bh * g.capacity * (D * bits / 8),
                              scale.const_data_ptr<meta_t>() + bh * nb * ng,
                              zero.defined() ? zero.const_data_ptr<meta_t>() + bh * nb * ng : nullptr,
                              window.const_data_ptr<fp_t>() + bh * g.window * D,
                              sink.const_data_ptr<fp_t>() + bh * g.sinks * D,
                              D, keys ? g.k_block_tokens : g.v_block_tokens, keys ? g.k_group : g.v_group,
                              g.sinks, g.window, q_count, static_cast<int>(bits)};
    r.init();
    return r;
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
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    // tiles of dequantized rows, zero-padded to a multiple of 8 rows for the register-blocked kernels
    std::vector<float> tile(kTileTokens * D, 0.0f), scores(G * ST);
    // folded values: p * scale per (head, group, row), p * zero summed per (head, group), the tile's
    // scales and zeros
    std::vector<float> pp(G * VG * kTileTokens), zsum(G * VG), sv(kTileTokens * VG), zv(kTileTokens * VG);
    for (int64_t it = begin; it < end; ++it) {
      // kv heads vary fastest: the items of one split run together and share its cos / sin rows in cache
      const int64_t h = it % H, bs = it / H, split = bs % io.splits, b = bs / io.splits;
      const int64_t n = io.lengths[b], t0 = split * ST, t1 = std::min(n, t0 + ST);
      const int64_t hq0 = b * g.q_heads + h * G;  // first query head of this kv head
      float* ml = io.part_ml + (hq0 * io.splits + split) * 2;
      float* acc = io.part_acc + (hq0 * io.splits + split) * D;
      const int64_t ml_stride = io.splits * 2, acc_stride = io.splits * D;
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
      const float* qg = io.q + hq0 * D;
      for (int64_t tt = t0; tt < t1; tt += kTileTokens) {
        keys.prefetch(tt + 2 * kTileTokens, kTileTokens);
        const int64_t nt = std::min(kTileTokens, t1 - tt);
        if (!io.cos) {
          if (!keys.load_tile(tt, nt, tile.data()))
            for (int64_t i = 0; i < nt; ++i) keys.load(tt + i, tile.data() + i * D);
        } else {
          const float* cs = io.cos + tt * g.rope_half;
          const float* sn = io.sin + tt * g.rope_half;
          if (g.interleaved || !keys.load_rope_tile(tt, nt, tile.data(), cs, sn, g.rope_half)) {
            for (int64_t i = 0; i < nt; ++i) {
              float* row = tile.data() + i * D;
              keys.load(tt + i, row);
              rope_row(row, cs + i * g.rope_half, sn + i * g.rope_half, g.rope_half, g.interleaved);
            }
          }
        }
        tile_scores<DC>(tile.data(), nt, D, qg, G, scores.data() + (tt - t0), ST);
      }
      // 2. partial softmax per query head
      for (int64_t gq = 0; gq < G; ++gq) {
        float* s = scores.data() + gq * ST;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t i = 0; i < len; ++i) m = s[i] > m ? s[i] : m;
        ml[gq * ml_stride] = m;
        ml[gq * ml_stride + 1] = exp_sum_row(s, len, m);
      }
      // 3. un-normalized output sum_t p_t v_t, a tile of values at a time
      auto values = reader(false, b, h, q_count);
      std::fill(zsum.begin(), zsum.end(), 0.0f);
      for (int64_t tt = t0; tt < t1; tt += kTileTokens) {
        values.prefetch(tt + 2 * kTileTokens, kTileTokens);
        const int64_t nt = std::min(kTileTokens, t1 - tt);
#if RKV_TILES_AVX2
        if constexpr (kFoldable) {
          if (fold_values && values.all_packed(tt, nt)) {
            values.row_params(tt, nt, sv.data(), zv.data());
            fold_probs(scores.data() + (tt - t0), ST, G, VG, nt, sv.data(), zv.data(), pp.data(), zsum.data());
            accumulate_codes<DC>(values.packed_row(tt), D * values.bits / 8, values.bits, nt,
                                 FoldedProbs{pp.data(), VG * kTileTokens, g.v_group / 8, kTileTokens}, G, acc,
                                 acc_stride);
            continue;
          }
        }
#endif
        if (!values.load_tile(tt, nt, tile.data()))
          for (int64_t i = 0; i < nt; ++i) values.load(tt + i, tile.data() + i * D);
        tile_accumulate<DC>(tile.data(), nt, D, scores.data() + (tt - t0), G, ST, acc, acc_stride);
      }
      if (fold_values)
        for (int64_t gq = 0; gq < G; ++gq)
          for (int64_t c = 0; c < D; ++c) acc[gq * acc_stride + c] += zsum[gq * VG + c / g.v_group];
    }
  });
}

// Tokens per split when the caller leaves it to the kernel: the power of two in [512, 2048] nearest
// above what makes kTargetItems work items (sequence, kv head, split). Longer splits cost fewer partial
// results to zero and merge, and restart fewer prefetch streams; the items still outnumber the cores,
// and power-of-two splits of power-of-two contexts share out evenly. A function of the shapes only,
// never of the thread count, so results stay bit-identical across thread counts.
int64_t default_split_tokens(int64_t rows, int64_t max_n) {
  constexpr int64_t kTargetItems = 32, kMin = 512, kMax = 2048;
  const int64_t want = (rows * max_n + kTargetItems - 1) / kTargetItems;
  int64_t split = kMin;
  while (split < want && split < kMax) split *= 2;
  return split;
}

// out (B, Hq, D) = merge of the splits of every query head, in split order.
void merge_splits(const DecodeGeometry& g, const Tensors& io, float* out) {
  const int64_t D = g.dim, rows = g.batch * g.q_heads;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      SoftmaxPartial total{-INFINITY, 0.0f};
      float* o = out + r * D;
      std::fill(o, o + D, 0.0f);
      for (int64_t s = 0; s < io.splits; ++s) {
        const float* ml = io.part_ml + (r * io.splits + s) * 2;
        const float* acc = io.part_acc + (r * io.splits + s) * D;
        SoftmaxPartial merged;
        float fa, fb;
        softmax_merge_factors(total, SoftmaxPartial{ml[0], ml[1]}, merged, fa, fb);
#pragma omp simd
        for (int64_t c = 0; c < D; ++c) o[c] = o[c] * fa + acc[c] * fb;
        total = merged;
      }
      const float inv = total.l > 0.0f ? 1.0f / total.l : 0.0f;  // no cached token: zero output
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) o[c] *= inv;
    }
  });
}

at::Tensor decode_attention_cpu(const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
                                const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                                const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                                const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                                const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                                int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
                                const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                                const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                                double scale, int64_t split_tokens) {
  DecodeGeometry g = check_decode_attention(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window,
                                            v_window, k_sink, v_sink, lengths, k_bits, v_bits, block, recent,
                                            rope_cos, rope_sin, rope_interleaved, k_signs, v_signs, split_tokens);
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  check_decode_lengths(g, len);
  // queries in fp32, pre-scaled, and rotated into the keys' Hadamard space
  const at::Tensor qf = decode_query(q, scale, k_signs);
  const at::Tensor cos = rope_cos.has_value() ? rope_cos->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor sin = rope_sin.has_value() ? rope_sin->to(at::kFloat).contiguous() : at::Tensor();

  const int64_t max_n = g.batch ? *std::max_element(len.const_data_ptr<int64_t>(), len.const_data_ptr<int64_t>() + g.batch) : 0;
  if (split_tokens == 0) g.split_tokens = default_split_tokens(g.batch * g.kv_heads, max_n);
  Tensors io;
  io.splits = std::max<int64_t>(1, (max_n + g.split_tokens - 1) / g.split_tokens);
  at::Tensor part_ml = at::empty({g.batch, g.q_heads, io.splits, 2}, qf.options());
  at::Tensor part_acc = at::empty({g.batch, g.q_heads, io.splits, g.dim}, qf.options());
  io.q = qf.const_data_ptr<float>();
  io.lengths = len.const_data_ptr<int64_t>();
  io.cos = cos.defined() ? cos.const_data_ptr<float>() : nullptr;
  io.sin = sin.defined() ? sin.const_data_ptr<float>() : nullptr;
  io.part_ml = part_ml.mutable_data_ptr<float>();
  io.part_acc = part_acc.mutable_data_ptr<float>();

  const auto c = [](const at::Tensor& t) { return t.contiguous(); };
  const at::Tensor kz = k_zero.has_value() ? c(*k_zero) : at::Tensor();
  const at::Tensor vz = v_zero.has_value() ? c(*v_zero) : at::Tensor();
  RKV_DISPATCH_FLOAT(k_window.scalar_type(), "rkv.decode_attention", fp_t, [&] {
    RKV_DISPATCH_FLOAT(k_scale.scalar_type(), "rkv.decode_attention", meta_t, [&] {
      const auto run = [&](auto dim_constant) {
        decode_kernel<fp_t, meta_t, decltype(dim_constant)::value>(g, io, c(k_packed), c(k_scale), kz, c(v_packed),
                                                                  c(v_scale), vz, c(k_window), c(v_window),
                                                                  c(k_sink), c(v_sink));
      };
      // head_dim as a compile-time constant for the common sizes: fully unrolled row loops
      switch (g.dim) {
        case 64: run(std::integral_constant<int, 64>{}); break;
        case 128: run(std::integral_constant<int, 128>{}); break;
        case 256: run(std::integral_constant<int, 256>{}); break;
        default: run(std::integral_constant<int, 0>{});
      }
    });
  });
  at::Tensor out = at::empty({g.batch, g.q_heads, g.dim}, qf.options());
  merge_splits(g, io, out.mutable_data_ptr<float>());
  return decode_output(out, v_signs, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) { m.impl("decode_attention", &decode_attention_cpu); }

}  // namespace rkv::cpu
