// Dense-and-sparse outliers (KVQuant's idea; docs/format.md, "Sparse outliers"): each completed block
// of `block` tokens x D channels of one kv head keeps up to K values outside its dense quantization,
// chosen so that the dense groups' ranges shrink most, in a fixed-size side buffer of K 32-bit entries.
// The spec is reference.select_outliers / reference.outlier_entries; this header is its arithmetic,
// shared by the CPU and CUDA kernels and bit-exact with the reference.
//
// Selection, greedy, one value at a time: a candidate is a finite value of a non-sink row that no
// earlier step took. For each quantizer group (T tokens x G channels of the block), taking its largest
// candidate shrinks its range r = hi - lo to r' = hi2 - lo (hi2: the largest of the rest), its smallest
// to r' = hi - lo2; the gain is r^2 - r'^2 = (r - r')(r + r') in float32 (the group's squared step, so
// its squared error, falls by that factor). Each step takes the largest gain > 0; ties go to the
// lower group index (groups in (tile row, channel group) order), then the high end; within a group
// among equal values, the lowest position. A group with one candidate has gain 0: it is never emptied.
// The dense part is then quantized with the taken values left out of every range (they still get codes).
//
// Entry: bits 31..16 the position t * D + c within the block, bits 15..0 the float16 residual
// x - x_hat (x_hat: the dense part's decoded value at that position), saturated to +-65504. Entries
// are sorted by position; unused ones are kOutlierEmpty (position 0xFFFF, residual 0), so positions
// must stay below 0xFFFF (block * D <= 65535) and a reader can stop at the first position past a row.
#pragma once

#include <c10/util/Half.h>

#include <cmath>

#include "rkv/macros.h"
#include "rkv/pack.h"
#include "rkv/paging.h"
#include "rkv/quant.h"

namespace rkv {

constexpr uint32_t kOutlierEmpty = 0xFFFF0000u;
constexpr int64_t kOutlierPositions = 0xFFFF;  // block * D must not exceed it

RKV_HD uint32_t outlier_entry(int64_t pos, float residual) {
  const c10::Half h(clamp_f(residual, -65504.0f, 65504.0f));
  return (static_cast<uint32_t>(pos) << 16) | static_cast<uint32_t>(h.x);
}
RKV_HD int64_t outlier_pos(uint32_t e) { return static_cast<int64_t>(e >> 16); }
RKV_HD float outlier_residual(uint32_t e) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(e & 0xFFFFu), c10::Half::from_bits()));
}
// The index of a block's first entry at or past position pos (count if none): entries are sorted by
// position (unused ones, 0xFFFF, last), so a reader of some rows skips the earlier rows' entries.
RKV_HD int64_t first_outlier(const uint32_t* e, int64_t count, int64_t pos) {
  int64_t k = 0, n = count;  // the answer lies in [k, k + n]
  while (n > 0) {
    const int64_t half = n / 2;
    if (outlier_pos(e[k + half]) < pos) {
      k += half + 1;
      n -= half + 1;
    } else {
      n = half;
    }
  }
  return k;
}

// The two largest and two smallest candidates of a group, visited in ascending position: the first of
// equal extremes keeps its position, the next equal value becomes the runner-up.
struct Extremes {
  float hi = -INFINITY, hi2 = -INFINITY, lo = INFINITY, lo2 = INFINITY;
  int64_t hi_pos = -1, lo_pos = -1, count = 0;
  RKV_HD void add(float x, int64_t pos) {
    ++count;
    if (x > hi) {
      hi2 = hi;
      hi = x;
      hi_pos = pos;
    } else if (x > hi2) {
      hi2 = x;
    }
    if (x < lo) {
      lo2 = lo;
      lo = x;
      lo_pos = pos;
    } else if (x < lo2) {
      lo2 = x;
    }
  }
  // r^2 - r'^2 for taking the high (or low) end; 0 with fewer than two candidates (or a NaN from an
  // overflowing range, which never wins)
  RKV_HD float gain(bool high) const {
    if (count < 2) return 0.0f;
    const float r = sub_rn(hi, lo), r2 = high ? sub_rn(hi2, lo) : sub_rn(hi, lo2);
    const float g = mul_rn(sub_rn(r, r2), add_rn(r, r2));
    return g == g ? g : 0.0f;
  }
};

// Where the quantizer groups of a block are: block rows x dim channels in tiles of T rows x G channels.
struct OutlierGroups {
  int64_t dim, tile_rows, group, sink_rows;  // sink_rows: the block's first rows that are sinks
  RKV_HD int64_t groups(int64_t block) const { return block / tile_rows * (dim / group); }
  // Extremes of group gi's candidates; value(pos) -> float, taken(pos) -> bool.
  template <typename Value, typename Taken>
  RKV_HD Extremes extremes(int64_t gi, const Value& value, const Taken& taken) const {
    Extremes e;
    const int64_t per_row = dim / group, t0 = gi / per_row * tile_rows, c0 = gi % per_row * group;
    for (int64_t t = t0 < sink_rows ? sink_rows : t0; t < t0 + tile_rows; ++t)
      for (int64_t c = c0; c < c0 + group; ++c) {
        const int64_t pos = t * dim + c;
        const float x = value(pos);
        if (is_finite(x) && !taken(pos)) e.add(x, pos);
      }
    return e;
  }
};

// The dense part's decoded value at position pos of the block whose first row is row0 of `page` (head h):
// its code and group parameters read back as stored, which an outlier's residual is taken against.
template <typename meta_t>
RKV_HD float dense_value(const SideView& side, const CacheGeometry& g, int64_t page, int64_t h, int64_t row0,
                         int64_t pos) {
  const int64_t row = row0 + pos / g.dim, c = pos % g.dim, meta = side.meta_offset(g, page, h, row) + c / side.group;
  const meta_t* scale = static_cast<const meta_t*>(side.scale);
  const meta_t* zero = static_cast<const meta_t*>(side.zero);
  const QParams p{static_cast<float>(scale[meta]), zero != nullptr ? static_cast<float>(zero[meta]) : 0.0f};
  const uint32_t code = unpack_code(side.codes + side.codes_offset(g, page, h, row), c, side.bits);
  return decode(code, p, side.bits, zero == nullptr, side.levels);
}

// Whether (gain, key) beats the best so far: larger gain, or an equal gain at a lower key (key = group
// * 2 + (0: high end, 1: low end)).
RKV_HD bool outlier_better(float gain, int64_t key, float best, int64_t best_key) {
  return gain > best || (gain == best && gain > 0.0f && key < best_key);
}

}  // namespace rkv
