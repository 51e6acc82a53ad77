// CPU instruction sets. The kernels that gain from one are compiled once per set, each in its own
// translation unit (cpu/attention_<set>.cpp), and one is chosen at run time from the CPU's features, the
// way ATen does it: no build flag depends on the build machine, and one build runs on every x86-64 CPU.
//
//   default  any CPU: portable C++ that the compiler vectorizes for the baseline instruction set
//   avx2     x86-64 with AVX2, FMA and F16C (Intel Haswell, AMD Zen and later): register-blocked tiles
//
// RKV_CPU_CAPABILITY=default|avx2 forces a level (CI runs the kernel tests on the portable path with
// it); forcing one this CPU or this build lacks is an error, never an illegal instruction.
//
// Code compiled per set lives in the inline namespace rkv::cpu::RKV_CPU_ISA ("base" in ordinary
// translation units), so the linker never merges the AVX2 copy of an inline function into code that
// runs on other CPUs. This header is ATen-free: the per-set translation units include it.
#pragma once

#ifndef RKV_CPU_ISA
#define RKV_CPU_ISA base
#endif
// 1 in the translation unit compiled for AVX2 + FMA + F16C, which sets the target with a pragma (in
// C++, GCC's target pragma does not define __AVX2__), 0 elsewhere. Code tests this macro, never the
// compiler's ISA macros, so a kernel means the same whatever flags the build passes.
#ifndef RKV_CPU_ISA_AVX2
#define RKV_CPU_ISA_AVX2 0
#endif

namespace rkv::cpu {

enum class Capability : int { Default = 0, Avx2 = 1 };

// The level the kernels use, chosen once per process (the override, else the best this CPU runs).
Capability capability();
const char* capability_name(Capability c);
// Whether this build has the level's kernels and this CPU (and OS) can run them.
bool supported(Capability c);
// Switches the level for every later call, by name ("default", "avx2"): for benchmarks and tests that
// time or compare both in one process. Not for use while a kernel runs on another thread.
void set_capability(const char* name);

}  // namespace rkv::cpu
