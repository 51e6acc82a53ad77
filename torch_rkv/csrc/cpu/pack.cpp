// CPU kernels of rkv::pack and rkv::unpack. They use the per-byte / per-code functions of
// include/rkv/pack.h, the same ones the CUDA kernels run, so these tests pin the GPU's layout too.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "rkv/pack.h"

namespace rkv::cpu {
namespace {

at::Tensor pack_cpu(const at::Tensor& codes_in, int64_t bits) {
  check_pack(codes_in, bits);
  const at::Tensor codes = codes_in.contiguous();
  const int64_t dim = codes.size(-1), rb = packed_row_bytes(dim, static_cast<int>(bits));
  std::vector<int64_t> shape(codes.sizes().begin(), codes.sizes().end());
  shape.back() = rb;
  at::Tensor out = at::empty(shape, codes.options());
  const int64_t rows = dim == 0 ? 0 : codes.numel() / dim;
  const uint8_t* cp = codes.const_data_ptr<uint8_t>();
  uint8_t* op = out.mutable_data_ptr<uint8_t>();
  // Codes must fit in `bits`: a wider value would silently lose its high bits.
  const uint8_t top = static_cast<uint8_t>(code_mask(static_cast<int>(bits)));
  const int64_t n = codes.numel();
  uint8_t worst = 0;
  for (int64_t i = 0; i < n; ++i) worst = cp[i] > worst ? cp[i] : worst;
  TORCH_CHECK_VALUE(worst <= top, "rkv.pack: codes must be < 2^bits = ", int(top) + 1, " (found ", int(worst), ")");
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t k = 0; k < rb; ++k) op[r * rb + k] = pack_byte(cp + r * dim, k, static_cast<int>(bits));
  });
  return out;
}

at::Tensor unpack_cpu(const at::Tensor& packed_in, int64_t bits) {
  check_unpack(packed_in, bits);
  const at::Tensor packed = packed_in.contiguous();
  const int64_t rb = packed.size(-1), dim = rb * 8 / bits;
  std::vector<int64_t> shape(packed.sizes().begin(), packed.sizes().end());
  shape.back() = dim;
  at::Tensor out = at::empty(shape, packed.options());
  const int64_t rows = rb == 0 ? 0 : packed.numel() / rb;
  const uint8_t* pp = packed.const_data_ptr<uint8_t>();
  uint8_t* op = out.mutable_data_ptr<uint8_t>();
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < dim; ++i)
        op[r * dim + i] = static_cast<uint8_t>(unpack_code(pp + r * rb, i, static_cast<int>(bits)));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
}

}  // namespace rkv::cpu
