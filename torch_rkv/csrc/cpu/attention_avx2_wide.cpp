// The AVX2 decode kernel for head dim 256 and any other head dim (attention_avx2.h).
#include "attention_avx2.h"

#if RKV_AVX2_KERNELS
RKV_AVX2_BEGIN
namespace rkv::cpu::avx2 {
AttentionItems attention_items_wide(int64_t dim) { return select_attention_items<256, 0>(dim); }
}  // namespace rkv::cpu::avx2
RKV_AVX2_END
#endif
