// CPU kernel of rkv::hadamard.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "../checks.h"
#include "../dispatch.h"
#include "rkv/hadamard.h"

namespace rkv::cpu {
namespace {

at::Tensor hadamard_cpu(const at::Tensor& x_in, const std::optional<at::Tensor>& signs_in, bool inverse) {
  check_hadamard(x_in, signs_in);
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t dim = x.size(-1), rows = x.numel() / dim, n = hadamard_block(dim);
  const float norm = hadamard_norm(n);
  const at::Tensor signs = signs_in.has_value() ? signs_in->contiguous().to(at::kFloat) : at::Tensor();
  const float* sg = signs.defined() ? signs.const_data_ptr<float>() : nullptr;
  if (rows == 0) return out;

  RKV_DISPATCH_FLOAT(x.scalar_type(), "rkv.hadamard", scalar_t, [&] {
    const scalar_t* xp = x.const_data_ptr<scalar_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      std::vector<float> v(dim);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* xr = xp + r * dim;
        // forward: H diag(s) x / sqrt(n); inverse: diag(s) H x / sqrt(n)
        for (int64_t c = 0; c < dim; ++c) {
          const float xv = static_cast<float>(xr[c]);
          v[c] = (sg && !inverse) ? mul_rn(xv, sg[c]) : xv;
        }
        for (int64_t b = 0; b < dim; b += n) fwht_block(v.data() + b, n);
        scalar_t* orow = op + r * dim;
        for (int64_t c = 0; c < dim; ++c) {
          const float y = mul_rn(v[c], norm);
          orow[c] = static_cast<scalar_t>((sg && inverse) ? mul_rn(y, sg[c]) : y);
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CPU, m) { m.impl("hadamard", &hadamard_cpu); }

}  // namespace rkv::cpu
