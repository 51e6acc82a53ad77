// The one schema block of the rkv library. The CPU kernels register in cpu/*.cpp; the GPU kernels are
// Triton kernels registered from Python (torch_rkv/gpu/); fake (meta) kernels, docstrings and Python
// wrappers live in torch_rkv/ops/. Semantics: reference.py.
#include <Python.h>
#include <torch/library.h>

#include <c10/util/Exception.h>

#include <exception>

#include "cpu/capability.h"

namespace {

// _C.cpu_capability() -> "default" | "avx2": the CPU kernels in use (cpu/capability.h). A bad
// RKV_CPU_CAPABILITY raises here, at import, with the variable named.
PyObject* cpu_capability(PyObject*, PyObject*) {
  try {
    return PyUnicode_FromString(rkv::cpu::capability_name(rkv::cpu::capability()));
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
    return nullptr;
  }
}

// _C._set_cpu_capability(name): switch the CPU kernels (benchmarks and tests compare both in one run).
PyObject* set_cpu_capability(PyObject*, PyObject* arg) {
  const char* name = PyUnicode_AsUTF8(arg);
  if (name == nullptr) return nullptr;
  try {
    rkv::cpu::set_capability(name);
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// _C.cpu_capabilities() -> the levels this build has and this CPU runs, best last.
PyObject* cpu_capabilities(PyObject*, PyObject*) {
  PyObject* out = PyList_New(0);
  for (auto c : {rkv::cpu::Capability::Default, rkv::cpu::Capability::Avx2}) {
    if (!rkv::cpu::supported(c)) continue;
    PyObject* name = PyUnicode_FromString(rkv::cpu::capability_name(c));
    PyList_Append(out, name);
    Py_DECREF(name);
  }
  return out;
}

PyMethodDef methods[] = {
    {"cpu_capability", cpu_capability, METH_NOARGS, "The CPU kernels in use: default or avx2."},
    {"cpu_capabilities", cpu_capabilities, METH_NOARGS, "The CPU kernel levels this build and CPU can run."},
    {"_set_cpu_capability", set_cpu_capability, METH_O, "Switch the CPU kernels: default or avx2."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

// `import torch_rkv._C` loads this shared object, which runs the static registrations below. The ops
// are reached through torch.ops.rkv; the module itself only says which CPU kernels run.
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  return m;
}

TORCH_LIBRARY(rkv, m) {
  // x (*, N, D) float -> packed codes (*, N, D*bits/8) uint8, scale and zero (*, N/block_tokens,
  // D/group_size) of meta_dtype. zero is empty (numel 0) when symmetric. clip: each group's range is
  // the least-squared-error one of 11 shrinkages of [min, max] (asymmetric only; include/rkv/quant.h).
  // sink_rows: tokens [0, sink_rows) (a cache's attention sinks) are encoded but do not set the range
  // of a group they share with other tokens. levels: non-uniform code values (2^bits,) float32, ascending
  // within [0, 2^bits - 1] (include/rkv/quant.h; asymmetric only), None: the uniform grid. Every op that
  // reads or writes codes takes them the same way (k_levels / v_levels for a cache's two sides).
  m.def(
      "quantize(Tensor x, int bits, SymInt group_size, SymInt block_tokens, bool symmetric, "
      "ScalarType meta_dtype, bool clip=False, SymInt sink_rows=0, Tensor? levels=None) -> (Tensor packed, Tensor scale, "
      "Tensor zero)");
  // Inverse of quantize; group size and block tokens are read off scale's shape. zero=None: symmetric.
  m.def(
      "dequantize(Tensor packed, Tensor scale, Tensor? zero, int bits, ScalarType out_dtype, Tensor? levels=None) "
      "-> Tensor");
  // codes (*, D) uint8 < 2^bits -> (*, D*bits/8) uint8 in the docs/format.md bit layout.
  m.def("pack(Tensor codes, int bits) -> Tensor");
  // packed (*, B) uint8 -> codes (*, B*8/bits) uint8.
  m.def("unpack(Tensor packed, int bits) -> Tensor");
  // Rotary embedding of x (*, D) at positions (broadcast to x.shape[:-1]) from cos/sin tables
  // (P, rot_dim/2); inverse=True undoes it.
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor positions, bool interleaved, bool inverse) -> Tensor");
  // Orthonormal Walsh-Hadamard transform of x (*, D) along D, optionally with +-1 signs (D,).
  m.def("hadamard(Tensor x, Tensor? signs, bool inverse) -> Tensor");
  // One decode step: attention of q (B, Hq, D) over each sequence's lengths[b] cached tokens in the
  // contiguous layout: sinks (B, Hkv, S, D), packed rows (B, Hkv, C, D*bits/8) with scale/zero
  // (B, Hkv, C/T, D/G), and a full-precision window ring (B, Hkv, W, D); see reference.decode_attention.
  // rope_cos/rope_sin: keys are stored pre-RoPE; k_signs / v_signs: keys / values are stored
  // Hadamard-rotated. sliding_window > 0: each query sees only the newest sliding_window keys, and the
  // contiguous cache is a ring (cache_append with the same window); softcap > 0: Gemma 2's
  // softcap * tanh(score / softcap) on the scaled scores; sink_logits (Hq,): learned attention sinks (GPT-OSS), a
  // logit per query head that joins every softmax with no value. The paged attention ops take them the
  // same way.
  m.def(
      "decode_attention(Tensor q, Tensor k_packed, Tensor k_scale, Tensor? k_zero, Tensor v_packed, "
      "Tensor v_scale, Tensor? v_zero, Tensor k_window, Tensor v_window, Tensor k_sink, Tensor v_sink, "
      "Tensor lengths, int k_bits, int v_bits, SymInt block, SymInt recent, Tensor? rope_cos, Tensor? rope_sin, "
      "bool rope_interleaved, Tensor? k_signs, Tensor? v_signs, float scale, SymInt split_tokens, "
      "SymInt sliding_window=0, float softcap=0.0, Tensor? k_levels=None, Tensor? v_levels=None, "
      "Tensor? k_outliers=None, Tensor? v_outliers=None, Tensor? sink_logits=None, Tensor? k_refine=None, "
      "Tensor? k_channels=None) -> Tensor");
  // Appends k_new / v_new (B, Hkv, m, D) after each sequence's lengths[b] tokens of the contiguous
  // layout, in place: completed blocks are quantized into the packed rows and metadata, other new tokens
  // go to the sinks or the window ring (reference.cache_append). Writes only the buffers marked (x!);
  // lengths is read only. k_clip / v_clip: completed blocks are quantized with quantize's clip search.
  // k_outliers / v_outliers (int32 (pages|batch, Hkv, rows/block, K), None: none): each completed block
  // keeps up to K sparse outliers (include/rkv/outliers.h) in its row of entries, left out of the dense
  // ranges; every op that reads or writes codes takes them the same way, paged_copy copies them.
  // k_refine (uint8 (pages|batch, Hkv, rows, m*extra/8)) with k_channels (int32 (Hkv, m)), None: none:
  // refined key channels (reference.refined_rows): those channels of each completed block keep their full
  // range and add an extra-bit code per row; every op that reads or writes keys takes them the same way.
  m.def(
      "cache_append(Tensor(a!) k_packed, Tensor(b!) k_scale, Tensor(c!)? k_zero, Tensor(d!) v_packed, "
      "Tensor(e!) v_scale, Tensor(f!)? v_zero, Tensor(g!) k_window, Tensor(h!) v_window, Tensor(i!) k_sink, "
      "Tensor(j!) v_sink, Tensor lengths, Tensor k_new, Tensor v_new, int k_bits, int v_bits, SymInt block, "
      "SymInt recent, bool k_clip=False, bool v_clip=False, SymInt sliding_window=0, Tensor? k_levels=None, "
      "Tensor? v_levels=None, Tensor(k!)? k_outliers=None, Tensor(l!)? v_outliers=None, Tensor(m!)? k_refine=None, "
      "Tensor? k_channels=None) -> ()");
  // The paged layout (reference.py, "The quantized KV cache"): codes (pages, Hkv, P, D*bits/8) and
  // scale/zero (pages, Hkv, P/T, D/G), contiguous within a page and any stride apart (views into one
  // page buffer), side slots (slots, Hkv, W|S, D); sequence b reads page block_tables[b][t / P] (int32
  // (B, max_pages)) and slot side_slots[b] (int32 (B,)); None: page b / slot b.
  //
  // Appends each sequence's new tokens, rows query_start_loc[b].. of k_new / v_new (T, Hkv, D), after
  // its lengths[b] tokens (reference.paged_append). page_fill (pages,) int32: quantized rows per page,
  // advanced as blocks complete, and a write into rows a page already holds is an error (None: no
  // guard). slot_mapping (T,): the engine's slot of each new token, checked against the tables.
  m.def(
      "paged_append(Tensor(a!) k_codes, Tensor(b!) k_scale, Tensor(c!)? k_zero, Tensor(d!) v_codes, "
      "Tensor(e!) v_scale, Tensor(f!)? v_zero, Tensor(g!) k_window, Tensor(h!) v_window, Tensor(i!) k_sink, "
      "Tensor(j!) v_sink, Tensor(k!)? page_fill, Tensor? block_tables, Tensor? side_slots, Tensor lengths, "
      "Tensor query_start_loc, Tensor k_new, Tensor v_new, int k_bits, int v_bits, SymInt block, SymInt recent, "
      "bool k_clip=False, bool v_clip=False, Tensor? slot_mapping=None, Tensor? k_levels=None, Tensor? v_levels=None, "
      "Tensor(l!)? k_outliers=None, Tensor(m!)? v_outliers=None, Tensor(n!)? k_refine=None, "
      "Tensor? k_channels=None) -> ()");
  // decode_attention over the paged layout: q (B, Hq, D), one query per sequence.
  m.def(
      "paged_decode_attention(Tensor q, Tensor k_codes, Tensor k_scale, Tensor? k_zero, Tensor v_codes, "
      "Tensor v_scale, Tensor? v_zero, Tensor k_window, Tensor v_window, Tensor k_sink, Tensor v_sink, "
      "Tensor? block_tables, Tensor? side_slots, Tensor lengths, int k_bits, int v_bits, SymInt block, "
      "SymInt recent, Tensor? rope_cos, Tensor? rope_sin, bool rope_interleaved, Tensor? k_signs, "
      "Tensor? v_signs, float scale, SymInt split_tokens, SymInt sliding_window=0, float softcap=0.0, "
      "Tensor? k_levels=None, Tensor? v_levels=None, Tensor? k_outliers=None, Tensor? v_outliers=None, "
      "Tensor? sink_logits=None, Tensor? k_refine=None, Tensor? k_channels=None) -> Tensor");
  // A chunk of new tokens per sequence, q (T, Hq, D) with query_start_loc (B+1) and their keys / values
  // k_new / v_new (T, Hkv, D) in the storage space: causal attention over the lengths[b] cached tokens
  // as stored and the chunk itself in full precision (reference.paged_prefill_attention). Runs before
  // the chunk's paged_append. max_query_len: the longest chunk (sizes the CUDA grid without a sync).
  m.def(
      "paged_prefill_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor query_start_loc, SymInt max_query_len, "
      "Tensor k_codes, Tensor k_scale, Tensor? k_zero, Tensor v_codes, Tensor v_scale, Tensor? v_zero, "
      "Tensor k_window, Tensor v_window, Tensor k_sink, Tensor v_sink, Tensor? block_tables, Tensor? side_slots, "
      "Tensor lengths, int k_bits, int v_bits, SymInt block, SymInt recent, Tensor? rope_cos, Tensor? rope_sin, "
      "bool rope_interleaved, Tensor? k_signs, Tensor? v_signs, float scale, SymInt split_tokens, "
      "SymInt sliding_window=0, float softcap=0.0, Tensor? k_levels=None, Tensor? v_levels=None, "
      "Tensor? k_outliers=None, Tensor? v_outliers=None, Tensor? sink_logits=None, Tensor? k_refine=None, "
      "Tensor? k_channels=None) -> Tensor");
  // Copies pages src_pages[i] -> dst_pages[i] (codes, metadata, outliers, refinement codes, page_fill) and side slots src_slots[j] ->
  // dst_slots[j] (sinks, window) in place: a fork's open page and side rows (reference.paged_copy).
  m.def(
      "paged_copy(Tensor(a!) k_codes, Tensor(b!) k_scale, Tensor(c!)? k_zero, Tensor(d!) v_codes, "
      "Tensor(e!) v_scale, Tensor(f!)? v_zero, Tensor(g!) k_window, Tensor(h!) v_window, Tensor(i!) k_sink, "
      "Tensor(j!) v_sink, Tensor(k!)? page_fill, Tensor src_pages, Tensor dst_pages, Tensor src_slots, "
      "Tensor dst_slots, Tensor(l!)? k_outliers=None, Tensor(m!)? v_outliers=None, Tensor(n!)? k_refine=None) -> ()");
}
