#include "capability.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "decode_kernel.h"

namespace rkv::cpu {

const char* capability_name(Capability c) { return c == Capability::Avx2 ? "avx2" : "default"; }

bool supported(Capability c) {
  switch (c) {
    case Capability::Default:
      return true;
    case Capability::Avx2:
#if defined(__x86_64__) && defined(__GNUC__)
      // __builtin_cpu_supports also checks that the OS saves the AVX registers (XCR0)
      __builtin_cpu_init();
      return avx2_kernels_built() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
#else
      return false;
#endif
  }
  return false;
}

namespace {

Capability parse(const char* what, const char* name) {
  for (Capability c : {Capability::Default, Capability::Avx2}) {
    if (std::strcmp(name, capability_name(c)) == 0) {
      TORCH_CHECK(supported(c), what, name, ": this CPU or this build of torch_rkv cannot run the ", name,
                  " kernels (use default)");
      return c;
    }
  }
  TORCH_CHECK_VALUE(false, what, name, " is not a CPU level torch_rkv knows (default, avx2)");
  return Capability::Default;
}

Capability choose() {
  const char* forced = std::getenv("RKV_CPU_CAPABILITY");
  if (forced == nullptr || *forced == '\0') return supported(Capability::Avx2) ? Capability::Avx2 : Capability::Default;
  return parse("RKV_CPU_CAPABILITY=", forced);
}

// The level in use: chosen once, changed only by set_capability (benchmarks and tests).
std::atomic<int>& current() {
  static std::atomic<int> level{static_cast<int>(choose())};
  return level;
}

}  // namespace

Capability capability() { return static_cast<Capability>(current().load(std::memory_order_relaxed)); }

void set_capability(const char* name) {
  current().store(static_cast<int>(parse("cpu capability ", name)), std::memory_order_relaxed);
}

}  // namespace rkv::cpu
