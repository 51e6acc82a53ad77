// The interface between rkv::decode_attention's CPU op (cpu/attention.cpp: checks, split policy,
// threads, merge) and its kernel, which is compiled once per instruction set (cpu/attention_<set>.cpp,
// cpu/capability.h). Plain pointers and integers only: the kernel translation units include no ATen
// header, so nothing compiled there for one instruction set is shared with code that runs elsewhere.
#pragma once

#include <cstdint>

#include "rkv/geometry.h"

namespace rkv::cpu {

constexpr int64_t kTileTokens = 32;  // rows per tile: a key and a value tile of D=128 fit in L1

// The storage dtype of a buffer the kernel reads: the window and sinks (one kind) and the metadata
// (another). A run-time switch per row or metadata block, not a template parameter: the conversion is
// a few instructions per row, and every dtype pair would otherwise be one more copy of the kernel.
enum class FloatKind : uint8_t { F32, F16, BF16 };

RKV_HD int64_t float_kind_size(FloatKind k) { return k == FloatKind::F32 ? 4 : 2; }

// One cached tensor (keys or values) of every sequence and kv head, contiguous.
struct CachedSide {
  const uint8_t* packed;  // (B*Hkv, C, D*bits/8)
  const void* scale;      // (B*Hkv, C/T, D/G), FloatKind meta
  const void* zero;       // same, or nullptr (symmetric)
  const void* window;     // (B*Hkv, W, D), FloatKind fp
  const void* sink;       // (B*Hkv, S, D), FloatKind fp
};

struct DecodeArgs {
  DecodeGeometry g;      // split_tokens already chosen (> 0)
  FloatKind fp, meta;
  CachedSide k, v;
  const float* q;        // (B, Hq, D): scaled (and rotated) queries
  const int64_t* lengths;
  const float* cos;      // (P, half) or nullptr (keys stored post-RoPE)
  const float* sin;
  float* part_ml;        // (B, Hq, splits, 2): max, sum
  float* part_acc;       // (B, Hq, splits, D)
  int64_t splits;
};

// One thread's scratch, carved from one float buffer of scratch_floats() floats.
struct ScratchLayout {
  int64_t tile, scores, folded, zsum, scales, zeros, k_meta, v_meta, codes, total;
  explicit ScratchLayout(const DecodeGeometry& g) {
    const int64_t D = g.dim, G = g.group_size(), VG = D / g.v_group;
    const int64_t kng = D / g.k_group, vng = D / g.v_group;
    int64_t at = 0;
    const auto take = [&at](int64_t n) {
      const int64_t start = at;
      at += (n + 15) / 16 * 16;  // 64-byte aligned pieces
      return start;
    };
    tile = take(kTileTokens * D);        // dequantized rows, zero-padded to a multiple of 8 rows
    scores = take(G * g.split_tokens);   // scores, then probabilities, of every query head
    folded = take(G * VG * kTileTokens); // folded values: p * scale per (head, group, row)
    zsum = take(G * VG);                 // and p * zero summed per (head, group)
    scales = take(kTileTokens * VG);     // the tile's value scales and zeros
    zeros = take(kTileTokens * VG);
    k_meta = take(2 * kng);              // a reader's current metadata row: scales, then zeros
    v_meta = take(2 * vng);
    codes = take((D + 3) / 4);           // one row of codes (bytes)
    total = at;
  }
};

// Runs work items [begin, end) of (sequence, split, kv head), writing their partial softmax results.
using DecodeItems = void (*)(const DecodeArgs& a, int64_t begin, int64_t end, float* scratch);

// The kernel for head_dim `dim` of each instruction set. decode_items_avx2 runs AVX2 code: call it only
// where capability() chose Avx2. avx2_kernels_built: whether this build has them (GCC's target pragmas
// on x86-64), safe on any CPU.
DecodeItems decode_items_default(int64_t dim);
DecodeItems decode_items_avx2(int64_t dim);
bool avx2_kernels_built();

}  // namespace rkv::cpu
