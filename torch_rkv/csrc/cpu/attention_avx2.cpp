// The decode kernel for x86-64 CPUs with AVX2, FMA and F16C (rkv::cpu::avx2), chosen at run time by
// capability.cpp. Its instruction set comes from the target pragma below, not from a build flag, so
// the build does not depend on the build machine's CPU.
//
// Everything this file shares with other translation units (the standard library, c10's Half and
// BFloat16, the per-element math of include/rkv) is included before the pragma and keeps the build's
// baseline instruction set; only the kernel, in its own namespace, is compiled for AVX2, and
// decode_items_avx2 itself (called on every CPU to ask whether the kernel exists) is baseline code.
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
#include "rkv/pack.h"
#include "rkv/quant.h"
#include "rkv/rope.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#undef RKV_CPU_ISA
#undef RKV_CPU_ISA_AVX2
#define RKV_CPU_ISA avx2
#define RKV_CPU_ISA_AVX2 1
#include "attention_kernel.h"
#pragma GCC pop_options

namespace rkv::cpu {
static_assert(RKV_TILES_AVX2, "the target pragma must enable the AVX2 tiles");
DecodeItems decode_items_avx2(int64_t dim) { return avx2::select_decode_items(dim); }
}  // namespace rkv::cpu

#else  // no GCC target pragmas (clang, MSVC) or not x86-64: the portable kernel only

namespace rkv::cpu {
DecodeItems decode_items_avx2(int64_t) { return nullptr; }
}  // namespace rkv::cpu

#endif
