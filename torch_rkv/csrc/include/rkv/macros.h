// Portability macros for math shared by the CPU and CUDA kernels.
//
// Every per-element function in include/rkv/ is RKV_HD: the CPU build compiles it as a plain inline
// function and nvcc as __host__ __device__, so the CPU tests exercise the arithmetic the GPU runs.
#pragma once

#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define RKV_HD __host__ __device__ __forceinline__
#else
#define RKV_HD inline
#endif

// Host hot-loop helpers that must inline so compile-time sizes reach their loops.
#if defined(__GNUC__)
#define RKV_INLINE inline __attribute__((always_inline))
#else
#define RKV_INLINE inline
#endif

#if defined(__CUDA_ARCH__)
#define RKV_DEVICE_CODE 1
#else
#define RKV_DEVICE_CODE 0
#endif

namespace rkv {

// fp32 add/sub/mul/div with exactly one IEEE rounding each. nvcc contracts a*b+c into an fma by
// default and would then disagree in the last bit with the CPU kernel and with reference.py (which
// rounds after each op); the _rn intrinsics are never contracted. The CPU build uses
// -ffp-contract=off for the same reason.
RKV_HD float mul_rn(float a, float b) {
#if RKV_DEVICE_CODE
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

RKV_HD float add_rn(float a, float b) {
#if RKV_DEVICE_CODE
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

RKV_HD float sub_rn(float a, float b) {
#if RKV_DEVICE_CODE
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

RKV_HD float div_rn(float a, float b) {
#if RKV_DEVICE_CODE
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// Fused multiply-add where rounding once is wanted (dot products, softmax accumulators): a single
// instruction on CUDA and on CPUs built with FMA, a mul+add elsewhere (never a slow libm call).
RKV_HD float fma_f(float a, float b, float c) {
#if RKV_DEVICE_CODE
  return __fmaf_rn(a, b, c);
#elif defined(__FMA__)
  return __builtin_fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

}  // namespace rkv
