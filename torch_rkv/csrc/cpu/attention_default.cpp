// The decode kernel in portable C++ for any CPU (rkv::cpu::base): the compiler vectorizes its loops
// for the build's baseline instruction set. capability.cpp chooses it where AVX2 is missing, or when
// RKV_CPU_CAPABILITY=default forces it.
#include "attention_kernel.h"

namespace rkv::cpu {

AttentionItems attention_items_default(int64_t dim) { return select_attention_items<64, 128, 256, 0>(dim); }

}  // namespace rkv::cpu
