// CUDA quantization of one block-row (block_tokens rows x dim channels) by a team of threads (a block or
// a warp): the same arithmetic as cpu/block_quant.h (include/rkv/quant.h), used by rkv::quantize and the
// cache append.
#pragma once

#include "common.cuh"
#include "rkv/pack.h"
#include "rkv/quant.h"

namespace rkv::cuda {

// Code i of one token row, computed from its group's stored parameters.
template <typename scalar_t, typename meta_t>
struct EncodeAt {
  const scalar_t* x;
  const meta_t* scale;
  const meta_t* zero;  // nullptr: symmetric
  int64_t group_size;
  int bits;
  const float* lut;  // non-uniform levels, or nullptr
  __device__ uint32_t operator()(int64_t i) const {
    const int64_t gi = i / group_size;
    const QParams p{static_cast<float>(scale[gi]), zero ? static_cast<float>(zero[gi]) : 0.0f};
    return encode(static_cast<float>(x[i]), p, bits, zero == nullptr, lut);
  }
};

// Values kept as sparse outliers (include/rkv/outliers.h): bit first + t * dim + c of a bitmask (shared
// memory) flags channel c of token t of the block; bits == nullptr: none.
struct Excluded {
  const uint32_t* bits = nullptr;
  int64_t first = 0;
  __device__ bool operator()(int64_t t, int64_t c, int64_t dim) const {
    if (bits == nullptr) return false;
    const int64_t k = first + t * dim + c;
    return ((bits[k >> 5] >> (k & 31)) & 1u) != 0;
  }
};

// Who quantizes one block-row together: the whole thread block (the default), or one warp, so that a
// block's warps take different small block-rows (per-token groups: one row of dim values) and none waits
// at a block-wide barrier while one warp finds the range.
struct BlockTeam {
  __device__ int rank() const { return threadIdx.x; }
  __device__ int size() const { return blockDim.x; }
  __device__ void sync() const { __syncthreads(); }
};
struct WarpTeam {
  __device__ int rank() const { return threadIdx.x & 31; }
  __device__ int size() const { return 32; }
  __device__ void sync() const { __syncwarp(); }  // also orders the warp's global writes before its reads
};

// src_row(t) -> const scalar_t* of token t of the block; dst_row(t) -> its packed row. Must be called
// by every thread of the team (it synchronizes the team). Parameters go to scale_out / zero_out first and are
// read back from there, so no shared memory is needed whatever dim is.
// The first sink_rows rows are encoded but do not set the ranges, unless every row is one
// (cpu/block_quant.h). lut: the side's non-uniform levels (include/rkv/quant.h), or nullptr. excluded:
// values encoded but left out of every range and clip error (sparse outliers).
template <typename scalar_t, typename meta_t, typename SrcRow, typename DstRow, typename Team = BlockTeam>
__device__ void quantize_block_row(const SrcRow& src_row, const DstRow& dst_row, int64_t block_tokens, int64_t dim,
                                   int64_t group_size, int bits, bool symmetric, bool clip, meta_t* scale_out,
                                   meta_t* zero_out, int64_t sink_rows = 0, const float* lut = nullptr,
                                   const Excluded& excluded = Excluded{}, const Team team = Team{}) {
  const int64_t groups = dim / group_size, t0 = sink_rows < block_tokens ? sink_rows : 0;
  const int rank = team.rank(), lane = rank & 31, warp = rank >> 5, warps = team.size() >> 5;
  if (group_size == 1) {
    // per-channel: one thread per channel walks the block's tokens (coalesced across threads)
    for (int64_t c = rank; c < dim; c += team.size()) {
      Range r;
      for (int64_t t = t0; t < block_tokens; ++t)
        if (!excluded(t, c, dim)) r.add(static_cast<float>(src_row(t)[c]));
      const auto channel_error = [&](QParams p) {
        double e = 0.0;
        for (int64_t t = t0; t < block_tokens; ++t)
          if (!excluded(t, c, dim)) e += clip_error(static_cast<float>(src_row(t)[c]), p, bits, lut);
        return e;
      };
      const QParams p = clip ? clipped_qparams<meta_t>(r.lo, r.hi, bits, channel_error)
                             : make_qparams<meta_t>(r.lo, r.hi, bits, symmetric);
      scale_out[c] = static_cast<meta_t>(p.scale);
      if (!symmetric) zero_out[c] = static_cast<meta_t>(p.zero);
    }
  } else {
    // one warp per group, lanes over its block_tokens x group_size elements
    for (int64_t gi = warp; gi < groups; gi += warps) {
      Range r;
      for (int64_t e = t0 * group_size + lane; e < block_tokens * group_size; e += 32) {
        const int64_t t = e / group_size, c = gi * group_size + e % group_size;
        if (!excluded(t, c, dim)) r.add(static_cast<float>(src_row(t)[c]));
      }
      const float lo = warp_min(r.lo), hi = warp_max(r.hi);
      // every lane runs the search in step: the warp sum gives all of them the same errors
      const auto group_error = [&](QParams p) {
        double e = 0.0;
        for (int64_t el = t0 * group_size + lane; el < block_tokens * group_size; el += 32) {
          const int64_t t = el / group_size, c = gi * group_size + el % group_size;
          if (!excluded(t, c, dim)) e += clip_error(static_cast<float>(src_row(t)[c]), p, bits, lut);
        }
        return warp_sum(e);
      };
      const QParams p = clip ? clipped_qparams<meta_t>(lo, hi, bits, group_error)
                             : make_qparams<meta_t>(lo, hi, bits, symmetric);
      if (lane == 0) {
        scale_out[gi] = static_cast<meta_t>(p.scale);
        if (!symmetric) zero_out[gi] = static_cast<meta_t>(p.zero);
      }
    }
  }
  team.sync();  // parameters visible to the whole team
  const int64_t row_bytes = dim * bits / 8;
  for (int64_t t = 0; t < block_tokens; ++t) {
    const EncodeAt<scalar_t, meta_t> code_at{src_row(t), scale_out, symmetric ? nullptr : zero_out, group_size, bits,
                                             lut};
    uint8_t* out = dst_row(t);
    for (int64_t k = rank; k < row_bytes; k += team.size()) out[k] = pack_byte_from(code_at, k, bits);
  }
}

}  // namespace rkv::cuda
