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

// x (a rotated row) += the rotation of r * e_c at the position whose table rows are cs / sn: what adding
// r to channel c before rope_apply adds after it (rope_apply is linear), so a sparse outlier's residual
// can join a key after its dense part was dequantized and rotated.
RKV_HD void rope_add(float* x, int64_t c, float r, const float* cs, const float* sn, int64_t half, bool interleaved) {
  if (c >= 2 * half) {  // partial rotary: not rotated
    x[c] = add_rn(x[c], r);
    return;
  }
  const int64_t j = interleaved ? c / 2 : (c < half ? c : c - half);
  const bool first = interleaved ? c % 2 == 0 : c < half;
  int64_t a, b;
  rope_pair_channels(j, half, interleaved, a, b);
  // first member: (x0, x1) += (r c, r s); second: (x0, x1) += (-r s, r c)
  x[a] = add_rn(x[a], first ? mul_rn(r, cs[j]) : -mul_rn(r, sn[j]));
  x[b] = add_rn(x[b], first ? mul_rn(r, sn[j]) : mul_rn(r, cs[j]));
}

}  // namespace rkv
