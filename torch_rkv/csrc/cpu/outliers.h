// CPU side of the sparse outliers (include/rkv/outliers.h): the greedy selection of one block's
// outliers, and their entries once the dense part is quantized. Used by the cache append.
#pragma once

#include <algorithm>
#include <vector>

#include "capability.h"
#include "rkv/outliers.h"

namespace rkv::cpu {
inline namespace RKV_CPU_ISA {

// Up to `count` positions of xs (block x dim floats) taken as outliers, ascending; taken[pos] is set
// for each. Each group's extremes are kept and only the group that lost a value is scanned again.
inline std::vector<int64_t> select_outliers(const float* xs, int64_t block, const OutlierGroups& og, int64_t count,
                                            std::vector<uint8_t>& taken) {
  taken.assign(block * og.dim, 0);
  const auto value = [&](int64_t pos) { return xs[pos]; };
  const auto is_taken = [&](int64_t pos) { return taken[pos] != 0; };
  const int64_t groups = og.groups(block);
  std::vector<Extremes> ext(groups);
  for (int64_t gi = 0; gi < groups; ++gi) ext[gi] = og.extremes(gi, value, is_taken);
  std::vector<int64_t> out;
  for (int64_t k = 0; k < count; ++k) {
    float best = 0.0f;
    int64_t best_key = -1;
    for (int64_t gi = 0; gi < groups; ++gi)
      for (int side = 0; side < 2; ++side) {
        const float g = ext[gi].gain(side == 0);
        if (outlier_better(g, 2 * gi + side, best, best_key)) {
          best = g;
          best_key = 2 * gi + side;
        }
      }
    if (best_key < 0) break;  // no group's range shrinks any more
    const int64_t gi = best_key / 2, pos = best_key % 2 == 0 ? ext[gi].hi_pos : ext[gi].lo_pos;
    taken[pos] = 1;
    out.push_back(pos);
    ext[gi] = og.extremes(gi, value, is_taken);
  }
  std::sort(out.begin(), out.end());
  return out;
}

// The block's `count` entries: one per taken position (x_hat(pos): the dense part's decoded value), then
// kOutlierEmpty.
template <typename Decoded>
void write_outliers(const float* xs, const std::vector<int64_t>& taken, const Decoded& x_hat, int64_t count,
                    uint32_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    const bool used = i < static_cast<int64_t>(taken.size());
    out[i] = used ? outlier_entry(taken[i], sub_rn(xs[taken[i]], x_hat(taken[i]))) : kOutlierEmpty;
  }
}

}  // namespace RKV_CPU_ISA
}  // namespace rkv::cpu
