// Orthonormal fast Walsh-Hadamard transform (Sylvester order) along one row.
//
// Sizes: a power of two n is transformed whole. Any other size D is transformed in independent blocks
// of n = the largest power of two dividing D (block-diagonal, still orthonormal); D must be even.
// Optional signs s (+-1 per channel) make the transform H*diag(s)/sqrt(n) ("random Hadamard"); its
// inverse is diag(s)*H/sqrt(n). Butterflies run stage by stage, h = 1, 2, 4, ..., pairing j with j+h,
// in the same order as reference.hadamard, so every backend agrees bit for bit.
#pragma once

#include <cmath>

#include "rkv/macros.h"

namespace rkv {

RKV_HD int64_t hadamard_block(int64_t dim) { return dim & (-dim); }

RKV_HD float hadamard_norm(int64_t n) { return static_cast<float>(1.0 / sqrt(static_cast<double>(n))); }

RKV_HD void butterfly(float& a, float& b) {
  const float s = add_rn(a, b);
  const float d = sub_rn(a, b);
  a = s;
  b = d;
}

// In-place unnormalized transform of one block of n (a power of two) contiguous values.
RKV_HD void fwht_block(float* v, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; ++j) butterfly(v[j], v[j + h]);
}

}  // namespace rkv
