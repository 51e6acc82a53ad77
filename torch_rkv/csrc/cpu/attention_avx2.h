// What the translation units of the AVX2 decode kernel share (attention_avx2.cpp: head dims 64 and
// 128; attention_avx2_wide.cpp: 256 and the generic kernel; two units, so they compile in parallel).
//
// The instruction set comes from a target pragma, not from a build flag, so the build does not depend
// on the build machine's CPU. Everything these units share with other code (the standard library,
// c10's Half and BFloat16, the per-element math of include/rkv) is included first and keeps the
// build's baseline instruction set; only code between RKV_AVX2_BEGIN and RKV_AVX2_END, in namespace
// rkv::cpu::avx2, is compiled for AVX2, and it runs only where capability() chose Avx2.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "capability.h"
#include "decode_kernel.h"
#include "rkv/attention.h"
#include "rkv/macros.h"
#include "rkv/outliers.h"
#include "rkv/pack.h"
#include "rkv/quant.h"
#include "rkv/rope.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define RKV_AVX2_KERNELS 1
#include <immintrin.h>
#define RKV_AVX2_BEGIN _Pragma("GCC push_options") _Pragma("GCC target(\"avx2,fma,f16c\")")
#define RKV_AVX2_END _Pragma("GCC pop_options")

RKV_AVX2_BEGIN
#undef RKV_CPU_ISA
#undef RKV_CPU_ISA_AVX2
#define RKV_CPU_ISA avx2
#define RKV_CPU_ISA_AVX2 1
#include "attention_kernel.h"
static_assert(RKV_TILES_AVX2, "the AVX2 unit must enable the AVX2 tiles");
RKV_AVX2_END

#else  // no GCC target pragmas (clang, MSVC) or not x86-64: the portable kernel only
#define RKV_AVX2_KERNELS 0
#endif
