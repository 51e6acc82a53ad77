// One call of a cache op (append, decode, prefill; contiguous or paged), checked and resolved into what
// the kernels of both backends take: geometry, addressing and the tensors behind every pointer. Host
// code only; the kernels differ per backend, this does not.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "checks.h"
#include "rkv/geometry.h"
#include "rkv/paging.h"

namespace rkv {

struct CacheCall {
  CacheGeometry g;
  PageTable pt;
  SideView k, v;
  at::Tensor lengths;        // (B,) int64
  at::Tensor tables, slots;  // what pt points into (undefined: the contiguous layout)
  at::ScalarType fp = at::kFloat;                         // dtype of the side rows
  at::ScalarType k_meta = at::kFloat, v_meta = at::kFloat;  // and of each side's metadata
  at::Tensor k_levels, v_levels;  // what k.levels / v.levels point into (undefined: uniform)
  at::Tensor k_channels;          // what k.channels points into (undefined: no refined key channels)
};

// Checks the cache and resolves its addressing. The pointers are into the caller's tensors (writable:
// for the ops that write them in place); `g` comes with batch, heads and dim set.
CacheCall resolve_cache(const char* op, const at::Tensor& ref, const CacheTensors& c, const CacheIndex& ix,
                        const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                        CacheGeometry g, bool writable);

struct AttentionCall {
  CacheCall cache;
  at::Tensor q;                 // fp32, scaled, rotated into the keys' Hadamard space: (query tokens, Hq, D)
  at::Tensor cos, sin;          // fp32 contiguous rope tables, or undefined
  at::Tensor q_start;           // (B+1) int64 query_start_loc, or undefined (decode)
  at::Tensor k_fresh, v_fresh;  // the chunk's keys / values (T, Hkv, D), contiguous, or undefined
  int64_t max_query_len = 1;    // query tokens of the longest sequence (decode: 1)
  at::Tensor sink_logits;             // (Hq,) fp32 learned attention sinks, or undefined (none)
};

// Checks learned attention sinks (one logit per query head of call.q, on its device) into call.sink_logits.
void attach_sink_logits(const char* op, AttentionCall& call, const std::optional<at::Tensor>& sink_logits);

// rkv::decode_attention (ix: contiguous) and rkv::paged_decode_attention: q (B, Hq, D).
AttentionCall decode_call(const char* op, const at::Tensor& q, const CacheTensors& c, const CacheIndex& ix,
                          const at::Tensor& lengths, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                          const std::optional<at::Tensor>& rope_cos, const std::optional<at::Tensor>& rope_sin,
                          bool rope_interleaved, const std::optional<at::Tensor>& k_signs,
                          const std::optional<at::Tensor>& v_signs, double scale, int64_t split_tokens,
                          int64_t sliding_window, double softcap);

// rkv::paged_prefill_attention: q (T, Hq, D), k_new / v_new (T, Hkv, D), query_start_loc (B+1).
AttentionCall prefill_call(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                           const at::Tensor& query_start_loc, int64_t max_query_len, const CacheTensors& c,
                           const CacheIndex& ix, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                           int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
                           const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                           const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                           double scale, int64_t split_tokens, int64_t sliding_window, double softcap);

struct AppendCall {
  CacheCall cache;
  FreshRows rows;                 // where new token i of sequence b is in k_new / v_new
  at::Tensor k_new, v_new;        // contiguous
  at::Tensor q_start;             // (B+1) int64 (undefined: the contiguous (B, H, m, D) input)
  int64_t tokens = 0;             // new tokens per sequence of the contiguous input (else unused)
  int32_t* page_fill = nullptr;   // (pages,) quantized rows of each page, or nullptr (no guard)
  at::Tensor slot_mapping;        // (T,) int64, or undefined
  bool k_clip = false, v_clip = false;
};

// rkv::cache_append: the contiguous layout, k_new / v_new (B, Hkv, m, D); sliding_window > 0: a ring.
AppendCall contiguous_append_call(const CacheTensors& c, const at::Tensor& lengths, const at::Tensor& k_new,
                                  const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block,
                                  int64_t recent, bool k_clip, bool v_clip, int64_t sliding_window);

// rkv::paged_append: k_new / v_new (T, Hkv, D) with query_start_loc (B+1).
AppendCall paged_append_call(const CacheTensors& c, const std::optional<at::Tensor>& page_fill, const CacheIndex& ix,
                             const at::Tensor& lengths, const at::Tensor& query_start_loc, const at::Tensor& k_new,
                             const at::Tensor& v_new, int64_t k_bits, int64_t v_bits, int64_t block, int64_t recent,
                             bool k_clip, bool v_clip, const std::optional<at::Tensor>& slot_mapping);

// Host-side checks of an append's data (CPU tensors; the CUDA kernels assert instead), before any write:
// capacity, page ids, slots, the immutability of quantized rows, slot_mapping.
void check_append_data(const char* op, const AppendCall& a);

}  // namespace rkv
