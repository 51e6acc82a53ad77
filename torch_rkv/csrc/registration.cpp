// The one schema block of the rkv library. Kernels register per backend in cpu/*.cpp and cuda/*.cu;
// fake (meta) kernels, docstrings and Python wrappers live in torch_rkv/ops/. Semantics: reference.py.
#include <Python.h>
#include <torch/library.h>

// `import torch_rkv._C` loads this shared object, which runs the static registrations below. The
// module itself is empty; everything is reached through torch.ops.rkv.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}

TORCH_LIBRARY(rkv, m) {
  // x (*, N, D) float -> packed codes (*, N, D*bits/8) uint8, scale and zero (*, N/block_tokens,
  // D/group_size) of meta_dtype. zero is empty (numel 0) when symmetric. clip: each group's range is
  // the least-squared-error one of 11 shrinkages of [min, max] (asymmetric only; include/rkv/quant.h).
  m.def(
      "quantize(Tensor x, int bits, SymInt group_size, SymInt block_tokens, bool symmetric, "
      "ScalarType meta_dtype, bool clip=False) -> (Tensor packed, Tensor scale, Tensor zero)");
  // Inverse of quantize; group size and block tokens are read off scale's shape. zero=None: symmetric.
  m.def("dequantize(Tensor packed, Tensor scale, Tensor? zero, int bits, ScalarType out_dtype) -> Tensor");
  // codes (*, D) uint8 < 2^bits -> (*, D*bits/8) uint8 in the docs/format.md bit layout.
  m.def("pack(Tensor codes, int bits) -> Tensor");
  // packed (*, B) uint8 -> codes (*, B*8/bits) uint8.
  m.def("unpack(Tensor packed, int bits) -> Tensor");
  // Rotary embedding of x (*, D) at positions (broadcast to x.shape[:-1]) from cos/sin tables
  // (P, rot_dim/2); inverse=True undoes it.
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool interleaved, bool inverse) -> Tensor");
  // Orthonormal Walsh-Hadamard transform of x (*, D) along D, optionally with +-1 signs (D,).
  m.def("hadamard(Tensor x, Tensor? signs, bool inverse) -> Tensor");
  // One decode step: attention of q (B, Hq, D) over each sequence's lengths[b] cached tokens, stored as
  // sinks (B, Hkv, S, D), packed rows (B, Hkv, C, D*bits/8) with scale/zero (B, Hkv, C/T, D/G), and a
  // full-precision window ring (B, Hkv, W, D); see reference.decode_attention. rope_cos/rope_sin:
  // keys are stored pre-RoPE; k_signs / v_signs: keys / values are stored Hadamard-rotated.
  m.def(
      "decode_attention(Tensor q, Tensor k_packed, Tensor k_scale, Tensor? k_zero, Tensor v_packed, "
      "Tensor v_scale, Tensor? v_zero, Tensor k_window, Tensor v_window, Tensor k_sink, Tensor v_sink, "
      "Tensor lengths, int k_bits, int v_bits, SymInt block, SymInt recent, Tensor? rope_cos, Tensor? rope_sin, "
      "bool rope_interleaved, Tensor? k_signs, Tensor? v_signs, float scale, SymInt split_tokens) -> Tensor");
  // Appends k_new / v_new (B, Hkv, m, D) after each sequence's lengths[b] tokens, in place: completed
  // blocks are quantized into the packed rows and metadata, other new tokens go to the sinks or the
  // window ring (reference.cache_append). Writes only the buffers marked (x!); lengths is read only.
  // k_clip / v_clip: completed blocks are quantized with quantize's clip search.
  m.def(
      "cache_append(Tensor(a!) k_packed, Tensor(b!) k_scale, Tensor(c!)? k_zero, Tensor(d!) v_packed, "
      "Tensor(e!) v_scale, Tensor(f!)? v_zero, Tensor(g!) k_window, Tensor(h!) v_window, Tensor(i!) k_sink, "
      "Tensor(j!) v_sink, Tensor lengths, Tensor k_new, Tensor v_new, int k_bits, int v_bits, SymInt block, "
      "SymInt recent, bool k_clip=False, bool v_clip=False) -> ()");
}
