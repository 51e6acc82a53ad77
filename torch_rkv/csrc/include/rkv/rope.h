// Rotary position embedding of one channel pair.
//
// Tables hold one (cos, sin) per position and pair: cos/sin have shape (positions, rot_dim / 2). Pair j
// of the first rot_dim channels is (j, j + rot_dim/2) for the rotate-half (Llama / NeoX) layout and
// (2j, 2j + 1) for the interleaved (GPT-J) layout; channels past rot_dim are left alone (partial
// rotary). Undo is the exact inverse of the table's 2x2 map, R^-1 = R^T / (cos^2 + sin^2), so tables
// scaled by an attention factor (YaRN) are undone exactly too.
#pragma once

#include "rkv/macros.h"

namespace rkv {

RKV_HD void rope_pair_channels(int64_t j, int64_t half, bool interleaved, int64_t& a, int64_t& b) {
  a = interleaved ? 2 * j : j;
  b = interleaved ? 2 * j + 1 : j + half;
}

RKV_HD void rope_apply(float& x0, float& x1, float c, float s) {
  const float y0 = sub_rn(mul_rn(x0, c), mul_rn(x1, s));
  const float y1 = add_rn(mul_rn(x1, c), mul_rn(x0, s));
  x0 = y0;
  x1 = y1;
}

RKV_HD void rope_undo(float& x0, float& x1, float c, float s) {
  const float n = add_rn(mul_rn(c, c), mul_rn(s, s));
  const float y0 = div_rn(add_rn(mul_rn(x0, c), mul_rn(x1, s)), n);
  const float y1 = div_rn(sub_rn(mul_rn(x1, c), mul_rn(x0, s)), n);
  x0 = y0;
  x1 = y1;
}

}  // namespace rkv
