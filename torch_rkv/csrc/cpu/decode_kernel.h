// The interface between the CPU attention ops (cpu/attention.cpp: checks, split policy, threads, merge)
// and their kernel, which is compiled once per instruction set (cpu/attention_<set>.cpp, cpu/capability.h).
// Plain pointers and integers only: the kernel translation units include no ATen header, so nothing
// compiled there for one instruction set is shared with code that runs elsewhere.
//
// One kernel serves rkv::decode_attention, rkv::paged_decode_attention and rkv::paged_prefill_attention:
// a work item is (sequence, block of query tokens, split of the keys, kv head), its query rows are the
// query heads of that kv head for each query token, and each row sees keys up to its own end (decode:
// every cached token; prefill: causal, over the cache and the chunk's own tokens before it).
#pragma once

#include <cstdint>

#include "rkv/attention.h"
#include "rkv/geometry.h"
#include "rkv/paging.h"

namespace rkv::cpu {

constexpr int64_t kTileTokens = 32;   // rows per tile: a key and a value tile of D=128 fit in L1
constexpr int64_t kChunkTokens = 512; // keys whose scores are held at once (an online softmax joins chunks)
// Query rows (tokens x query heads of a kv head) x head_dim per prefill work item: every item dequantizes
// (and rotates) the keys it reads once for all its rows, so more rows per item means fewer passes over
// the prefix; past this their queries and outputs (64 KB each) leave L2. bench_paged's prefill case, in
// one run: 32 rows per item took 174 ms (9q/3kv/d64) and 1259 ms (32q/8kv/d128), this 135 ms and 1018 ms
// (docs/performance.md).
constexpr int64_t kPrefillRowFloats = 16384;
inline int64_t prefill_rows(int64_t dim) { return kPrefillRowFloats / dim; }

// The storage dtype of a buffer the kernel reads: the window, sinks and new tokens (one kind) and the
// metadata (another). A run-time switch per row or metadata block, not a template parameter: the
// conversion is a few instructions per row, and every dtype pair would otherwise be one more copy of
// the kernel.
enum class FloatKind : uint8_t { F32, F16, BF16, F8E4M3 };

RKV_HD int64_t float_kind_size(FloatKind k) { return k == FloatKind::F32 ? 4 : k == FloatKind::F8E4M3 ? 1 : 2; }

struct AttentionArgs {
  CacheGeometry g;       // split_tokens already chosen (> 0)
  PageTable pt;
  FloatKind fp, k_meta, v_meta;  // the side rows', and each side's metadata
  SideView k, v;
  const float* q;        // scaled (and rotated) queries: (B, Hq, D) for decode, (T, Hq, D) for prefill
  const int64_t* lengths;  // cached tokens per sequence
  // prefill: query_start_loc (B+1) and the chunk's own keys / values (T, Hkv, D, fp kind, storage space);
  // decode: q_start == nullptr (one query per sequence, row b, seeing its cached tokens)
  const int64_t* q_start = nullptr;
  const void* k_fresh = nullptr;
  const void* v_fresh = nullptr;
  int64_t q_block = 1;   // query tokens per work item
  int64_t q_blocks = 1;  // work items along the queries of a sequence
  const float* cos;      // (P, half) or nullptr (keys stored post-RoPE)
  const float* sin;
  float* part_ml;        // (query tokens, Hq, splits, 2): max, sum
  float* part_acc;       // (query tokens, Hq, splits, D)
  float* out = nullptr;  // (query tokens, Hq, D): with one split, the items write the outputs themselves
  const float* sink_logits = nullptr;  // (Hq,) learned attention sinks, or nullptr (none)
  int64_t splits;
  int64_t rows() const { return g.group_size() * q_block; }  // query rows per work item
  float sink_logit(int64_t row) const { return row_sink_logit(sink_logits, row, g.q_heads); }  // of output row `row`
};

// One thread's scratch, carved from one float buffer of `total` floats.
struct ScratchLayout {
  int64_t tile, queries, scores, acc, ml, folded, zsum, scales, zeros, k_meta, v_meta, codes, total;
  explicit ScratchLayout(const AttentionArgs& a) {
    const CacheGeometry& g = a.g;
    const int64_t D = g.dim, R = a.rows(), VG = D / g.v_group;
    const int64_t kng = D / g.k_group, vng = D / g.v_group;
    int64_t at = 0;
    const auto take = [&at](int64_t n) {
      const int64_t start = at;
      at += (n + 15) / 16 * 16;  // 64-byte aligned pieces
      return start;
    };
    tile = take(kTileTokens * D);        // dequantized rows, zero-padded to a multiple of 8 rows
    queries = take(R * D);               // the item's query rows, gathered
    scores = take(R * kChunkTokens);     // scores, then probabilities, of every query row over a chunk
    acc = take(R * D);                   // un-normalized outputs
    ml = take(2 * R);                    // running max and sum of every row
    folded = take(R * VG * kTileTokens); // folded values: p * scale per (row, group, token)
    zsum = take(R * VG);                 // and p * zero summed per (row, group)
    scales = take(kTileTokens * VG);     // the tile's value scales and zeros
    zeros = take(kTileTokens * VG);
    k_meta = take(2 * kng);              // a reader's current metadata row: scales, then zeros
    v_meta = take(2 * vng);
    codes = take((D + 3) / 4);           // one row of codes (bytes)
    total = at;
  }
};

// Runs work items [begin, end) of (sequence, query block, split, kv head), writing their partial
// softmax results.
using AttentionItems = void (*)(const AttentionArgs& a, int64_t begin, int64_t end, float* scratch);

// The kernel for head_dim `dim` of each instruction set. attention_items_avx2 runs AVX2 code: call it
// only where capability() chose Avx2. avx2_kernels_built: whether this build has them (GCC's target
// pragmas on x86-64), safe on any CPU.
AttentionItems attention_items_default(int64_t dim);
AttentionItems attention_items_avx2(int64_t dim);
bool avx2_kernels_built();

}  // namespace rkv::cpu
