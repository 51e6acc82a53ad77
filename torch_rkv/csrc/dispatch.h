// dtype dispatch for the three float types every op accepts (and the metadata types).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

// RKV_DISPATCH_FLOAT(dtype, "rkv.op", T, [&] { ... uses T ... });
#define RKV_DISPATCH_FLOAT(DTYPE, OPNAME, T, ...)                                   \
  switch (DTYPE) {                                                                 \
    case at::ScalarType::Float: {                                                  \
      using T = float;                                                             \
      __VA_ARGS__();                                                               \
      break;                                                                       \
    }                                                                              \
    case at::ScalarType::Half: {                                                   \
      using T = c10::Half;                                                         \
      __VA_ARGS__();                                                               \
      break;                                                                       \
    }                                                                              \
    case at::ScalarType::BFloat16: {                                               \
      using T = c10::BFloat16;                                                     \
      __VA_ARGS__();                                                               \
      break;                                                                       \
    }                                                                              \
    default:                                                                       \
      TORCH_CHECK_TYPE(false, OPNAME ": unsupported dtype ", DTYPE,                \
                       " (expected float32, float16 or bfloat16)");                \
  }

// RKV_DISPATCH_META(dtype, "rkv.op", T, [&] { ... }): the metadata dtypes, the three floats and float8 e4m3.
#define RKV_DISPATCH_META(DTYPE, OPNAME, T, ...)                                    \
  if ((DTYPE) == at::ScalarType::Float8_e4m3fn) {                                  \
    using T = c10::Float8_e4m3fn;                                                  \
    __VA_ARGS__();                                                                 \
  } else {                                                                         \
    RKV_DISPATCH_FLOAT(DTYPE, OPNAME, T, __VA_ARGS__);                             \
  }
