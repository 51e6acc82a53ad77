// Row conversions between the storage dtypes and fp32 for the CPU kernels.
//
// c10::Half's scalar conversion is a branchy bit-trick that blocks vectorization; in the AVX2 translation
// unit (capability.h) these use F16C's vcvtph2ps / vcvtps2ph (round to nearest even, as c10 does), and
// the bfloat16 paths are the same integer arithmetic as c10::BFloat16 written so the compiler
// vectorizes it.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <cstring>

#include "capability.h"
#include "rkv/macros.h"

#if RKV_CPU_ISA_AVX2
#include <immintrin.h>
#endif

namespace rkv::cpu {
inline namespace RKV_CPU_ISA {

RKV_INLINE void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

RKV_INLINE void to_float(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if RKV_CPU_ISA_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

RKV_INLINE void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    dst[i] = f;
  }
}

// float8 e4m3 (metadata only): c10's exact conversion; a block's metadata row is a few values.
RKV_INLINE void to_float(const c10::Float8_e4m3fn* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if RKV_CPU_ISA_AVX2
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* d = reinterpret_cast<uint16_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;  // round to nearest even
    d[i] = static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
  }
}

}  // namespace RKV_CPU_ISA
}  // namespace rkv::cpu
