// CPU kernel of rkv::rope.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "../dispatch.h"
#include "rkv/rope.h"

namespace rkv::cpu {
namespace {

at::Tensor rope_cpu(const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in,
                    const at::Tensor& positions, bool interleaved, bool inverse) {
  check_rope(x_in, cos_in, sin_in, positions);
  const at::Tensor x = x_in.contiguous();
  const at::Tensor cos = cos_in.contiguous().to(at::kFloat);
  const at::Tensor sin = sin_in.contiguous().to(at::kFloat);
  const at::Tensor pos = rope_row_positions(x, positions);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t dim = x.size(-1), rows = pos.numel(), half = cos.size(1), table = cos.size(0);
  const int64_t* pp = pos.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK_VALUE(pp[r] >= 0 && pp[r] < table, "rkv.rope: positions contains ", pp[r],
                      ", outside the cos/sin table of ", table, " positions");
  if (rows == 0) return out;

  RKV_DISPATCH_FLOAT(x.scalar_type(), "rkv.rope", scalar_t, [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    const float* cp = cos.const_data_ptr<float>();
    const float* sp = sin.const_data_ptr<float>();
    at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * dim;
        scalar_t* orow = op + r * dim;
        const float* cr = cp + pp[r] * half;
        const float* sr = sp + pp[r] * half;
        for (int64_t c = 2 * half; c < dim; ++c) orow[c] = xr[c];
        for (int64_t j = 0; j < half; ++j) {
          int64_t a, b;
          rope_pair_channels(j, half, interleaved, a, b);
          float x0 = static_cast<float>(xr[a]), x1 = static_cast<float>(xr[b]);
          if (inverse) {
            rope_undo(x0, x1, cr[j], sr[j]);
          } else {
            rope_apply(x0, x1, cr[j], sr[j]);
          }
          orow[a] = static_cast<scalar_t>(x0);
          orow[b] = static_cast<scalar_t>(x1);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) { m.impl("rope", &rope_cpu); }

}  // namespace rkv::cpu
