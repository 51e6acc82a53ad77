// The AVX2 decode kernel for head dims 64 and 128, and the entry points (attention_avx2.h).
#include "attention_avx2.h"

namespace rkv::cpu {

#if RKV_AVX2_KERNELS
RKV_AVX2_BEGIN
namespace avx2 {
AttentionItems attention_items_narrow(int64_t dim) { return select_attention_items<64, 128>(dim); }
AttentionItems attention_items_wide(int64_t dim);  // attention_avx2_wide.cpp
}  // namespace avx2
RKV_AVX2_END

// Baseline code: capability.cpp asks on every CPU.
bool avx2_kernels_built() { return true; }
AttentionItems attention_items_avx2(int64_t dim) {
  const AttentionItems narrow = avx2::attention_items_narrow(dim);
  return narrow != nullptr ? narrow : avx2::attention_items_wide(dim);
}
#else
bool avx2_kernels_built() { return false; }
AttentionItems attention_items_avx2(int64_t) { return nullptr; }
#endif

}  // namespace rkv::cpu
