// CUDA kernel of rkv::decode_attention, rkv::paged_decode_attention and rkv::paged_prefill_attention
// (flash-decoding over the quantized cache, contiguous or paged).
//
// Grid (split x row chunk, kv head, sequence); 4 warps per block. A block owns up to kHeads query rows
// of one sequence (decode: the query heads of a GQA group; prefill: query tokens x heads, each row causal
// with its own end). Each warp walks every 4th token of the block's split; its 32 lanes each own up to
// kSlots channel pairs ("slots"), chosen so that a lane holds both members of its RoPE pairs. Per token a
// lane reads its codes once from the page row (include/rkv/paging.h), dequantizes and rotates them in
// registers (include/rkv/*.h, the CPU kernel's arithmetic), the warp reduces the dot products for its
// rows, and keeps an online softmax and the output in registers. The warps of a block are merged in
// shared memory, the splits of a row by a second kernel in split order.
//
// Registers decide the speed: the queries and outputs a lane keeps are 4 x kHeads x kSlots floats, so
// the kernel is compiled for the few (kHeads, kSlots) a call needs (run_attention picks the smallest),
// and per-token addressing avoids 64-bit division (a cursor over pages, 32-bit metadata rows).
#include <ATen/ops/zeros.h>

#include "../cache_call.h"
#include "../cache_ops.h"
#include "../op_common.h"
#include "common.cuh"
#include "rkv/attention.h"
#include "rkv/outliers.h"
#include "rkv/pack.h"
#include "rkv/paging.h"
#include "rkv/quant.h"
#include "rkv/rope.h"

namespace rkv::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxSlots = 8;  // channel pairs per lane: head_dim <= 2 * 32 * 8 = 512 (Gemma 4's global layers)
constexpr int64_t kDefaultSplit = 128;

// The two channels of a lane's slot p: RoPE pairs when keys are rotated, neighbours otherwise.
__device__ __forceinline__ void slot_channels(int p, int half, bool interleaved, int& a, int& b) {
  if (half > 0 && !interleaved && p < half) {
    a = p;
    b = p + half;
  } else if (half > 0 && !interleaved) {
    a = 2 * half + 2 * (p - half);
    b = a + 1;
  } else {
    a = 2 * p;
    b = 2 * p + 1;
  }
}

// One cached tensor (keys or values) of the call, typed; addressing through the shared SideView.
template <typename fp_t, typename meta_t>
struct Side {
  SideView view;
  const fp_t* fresh;  // prefill: the chunk's rows (T, Hkv, D), or nullptr

  // Where one token's row is: a full-precision row, or the codes and metadata of a quantized one.
  struct Row {
    const fp_t* fp;  // nullptr: quantized
    const uint8_t* codes;
    const meta_t* scale;
    const meta_t* zero;         // nullptr: symmetric
    const uint32_t* outliers;   // the sparse outliers of its block, or nullptr
    int64_t r;                  // quantized: the row in its page
  };

  // Token t of (sequence b, kv head h), which lives at `place`: a quantized token in row r of `page`, a
  // full-precision one in side slot `slot`, a new one at row q_row0 + t - n of `fresh`.
  __device__ Row row(const CacheGeometry& g, Place place, int64_t page, int64_t r, int64_t h, int64_t slot, int64_t t,
                     int64_t n, int64_t q_row0) const {
    switch (place) {
      case Place::Sink: return {static_cast<const fp_t*>(view.sink) + sink_offset(g, slot, h, t)};
      case Place::Window: return {static_cast<const fp_t*>(view.window) + window_offset(g, slot, h, t)};
      case Place::Fresh: return {fresh + ((q_row0 + t - n) * g.kv_heads + h) * g.dim};
      default: {
        CUDA_KERNEL_ASSERT_MSG(page >= 0 && page < g.pages, "rkv: a block table names a page outside the pool");
        const int64_t meta = view.meta_offset(g, page, h, r);
        return {nullptr, view.codes + view.codes_offset(g, page, h, r), static_cast<const meta_t*>(view.scale) + meta,
                view.zero ? static_cast<const meta_t*>(view.zero) + meta : nullptr,
                view.outliers ? view.outliers + view.outlier_offset(g, page, h, r) : nullptr, r};
      }
    }
  }

  // Channels a and c of a row.
  __device__ float2 load(const CacheGeometry& g, const Row& row, int a, int c) const {
    if (row.fp != nullptr) return make_float2(static_cast<float>(row.fp[a]), static_cast<float>(row.fp[c]));
    const bool sym = row.zero == nullptr;
    const int ga = a / static_cast<int>(view.group), gc = c / static_cast<int>(view.group);
    const QParams pa{static_cast<float>(row.scale[ga]), sym ? 0.0f : static_cast<float>(row.zero[ga])};
    const QParams pc{static_cast<float>(row.scale[gc]), sym ? 0.0f : static_cast<float>(row.zero[gc])};
    float2 xy = make_float2(decode(unpack_code(row.codes, a, view.bits), pa, view.bits, sym, view.levels),
                            decode(unpack_code(row.codes, c, view.bits), pc, view.bits, sym, view.levels));
    if (row.outliers != nullptr) add_outliers(g, row, a, c, xy);
    return xy;
  }

  // The sparse outliers (include/rkv/outliers.h) of channels a and c of a quantized row, added to their
  // dequantized values (pre-RoPE, like the codes). The block's entries are sorted by position: a binary
  // search finds the row's first, the scan stops past the row.
  __device__ void add_outliers(const CacheGeometry& g, const Row& row, int64_t a, int64_t c, float2& xy) const {
    const uint32_t* e = row.outliers;
    const int64_t lo = row.r % g.block * g.dim, hi = lo + g.dim;
    for (int64_t k = first_outlier(e, view.outlier_count, lo); k < view.outlier_count; ++k) {
      const int64_t pos = outlier_pos(e[k]);
      if (pos >= hi) break;
      if (pos - lo == a) xy.x = add_rn(xy.x, outlier_residual(e[k]));
      if (pos - lo == c) xy.y = add_rn(xy.y, outlier_residual(e[k]));
    }
  }
};

// One thread block: up to kHeads query rows (query token i, query head g of the kv head) of one
// sequence, each seeing keys [0, end). q_start: (B+1) prefill, or nullptr (decode: one query per
// sequence, row b).
template <typename fp_t, typename meta_t, int kHeads, int kSlots>
__global__ void __launch_bounds__(kWarps * 32)
    attention_split_kernel(CacheGeometry g, PageTable pt, const float* __restrict__ q,
                           const int64_t* __restrict__ lengths, const int64_t* __restrict__ q_start, Side<fp_t, meta_t> keys,
                           Side<fp_t, meta_t> values, const float* __restrict__ cos, const float* __restrict__ sin,
                           int64_t splits, float* __restrict__ part_ml, float* __restrict__ part_acc) {
  // grid.x: the splits of each row chunk (grid.x allows 2^31 - 1 blocks, grid.y 65535)
  const int64_t split = blockIdx.x % splits, row0 = blockIdx.x / splits * kHeads;
  const int64_t b = blockIdx.z, h = blockIdx.y, G = g.group_size();
  const bool prefill = q_start != nullptr;
  const int64_t m = prefill ? q_start[b + 1] - q_start[b] : 1, q_row0 = prefill ? q_start[b] : b;
  const int64_t left = G * m - row0;
  if (left <= 0) return;  // a shorter chunk than the longest: no rows here (uniform across the block)
  const int nh = static_cast<int>(left < kHeads ? left : kHeads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = lengths[b], slot = pt.slot(b);
  const int d = static_cast<int>(g.dim), slots = d / 2, half = static_cast<int>(g.rope_half);
  CUDA_KERNEL_ASSERT_MSG(n >= 0 && n + (prefill ? m : 0) <= g.max_tokens(),
                         "rkv: lengths beyond the tokens a sequence's pages address");
  CUDA_KERNEL_ASSERT_MSG(g.rope_half == 0 || n + (prefill ? m : 0) <= g.rope_positions,
                         "rkv: lengths beyond the rope_cos / rope_sin table");
  CUDA_KERNEL_ASSERT_MSG(slot >= 0 && slot < g.slots, "rkv: side_slots names a slot outside the pool");
  // query row j = row0 + j: query token i = (row0 + j) / G, head (row0 + j) % G. It sees keys [0, n + past[j])
  // (past: decode 0, prefill i + 1), or with a sliding window W the newest W of them.
  const auto q_row = [&](int j) { const int64_t r = row0 + j; return (q_row0 + r / G) * g.q_heads + h * G + r % G; };
  int past[kHeads];
#pragma unroll
  for (int j = 0; j < kHeads; ++j) past[j] = prefill ? static_cast<int>((row0 + (j < nh ? j : 0)) / G + 1) : 0;
  const int64_t t_end = prefill ? n + (row0 + nh - 1) / G + 1 : n, W = g.sliding_window;  // the last row's end
  const auto sees = [&](int j, int64_t t) { return t - n < past[j] && (W == 0 || t - n + W >= past[j]); };
  const int64_t t0 = split_base(n, prefill, g.sliding_window) + split * g.split_tokens;
  const int64_t t1 = t_end < t0 + g.split_tokens ? t_end : t0 + g.split_tokens;
  const int64_t q_count = quantized_count(n, g.recent, g.block);

  // this lane's channels and query values
  int ca[kSlots], cb[kSlots];
  float qa[kHeads][kSlots], qb[kHeads][kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int p = lane + 32 * i;
    ca[i] = cb[i] = 0;
    if (p < slots) slot_channels(p, half, g.interleaved, ca[i], cb[i]);
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      const bool on = p < slots && j < nh;
      qa[j][i] = on ? q[q_row(j) * d + ca[i]] : 0.0f;
      qb[j][i] = on ? q[q_row(j) * d + cb[i]] : 0.0f;
    }
  }

  float mx[kHeads], l[kHeads], acc_a[kHeads][kSlots], acc_b[kHeads][kSlots];
#pragma unroll
  for (int j = 0; j < kHeads; ++j) {
    mx[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) acc_a[j][i] = acc_b[j][i] = 0.0f;
  }

  PageCursor page;  // the page of this warp's tokens: one table read per page, no division per token
  for (int64_t t = t0 + warp; t < t1; t += kWarps) {
    const Place place = token_place(t, g.sinks, q_count, n);  // warp-uniform
    if (place == Place::Packed) page.seek(pt, b, t);
    const auto krow = keys.row(g, place, page.page, page.row(t), h, slot, t, n, q_row0);
    const auto vrow = values.row(g, place, page.page, page.row(t), h, slot, t, n, q_row0);
    float ka[kSlots], kb[kSlots], va[kSlots], vb[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      const int p = lane + 32 * i;
      ka[i] = kb[i] = va[i] = vb[i] = 0.0f;
      if (p >= slots) continue;
      const float2 k2 = keys.load(g, krow, ca[i], cb[i]);
      const float2 v2 = values.load(g, vrow, ca[i], cb[i]);
      ka[i] = k2.x;
      kb[i] = k2.y;
      va[i] = v2.x;
      vb[i] = v2.y;
      if (cos != nullptr && p < half) rope_apply(ka[i], kb[i], cos[t * half + p], sin[t * half + p]);
    }
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      if (j >= nh || !sees(j, t)) continue;  // warp-uniform
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) partial = fma_f(qa[j][i], ka[i], fma_f(qb[j][i], kb[i], partial));
      const float score = softcap_score(warp_sum(partial), g.softcap);
      const float m_new = fmaxf(mx[j], score);
      // -inf guards: the first token (m = -inf) and a -inf score (an infinite key) weigh 0, not NaN
      const float corr = mx[j] == -INFINITY ? 0.0f : softmax_exp(mx[j] - m_new);
      const float p = m_new == -INFINITY ? 0.0f : softmax_exp(score - m_new);
      l[j] = fma_f(l[j], corr, p);
      mx[j] = m_new;
#pragma unroll
      for (int i = 0; i < kSlots; ++i) {
        acc_a[j][i] = fma_f(acc_a[j][i], corr, p * va[i]);
        acc_b[j][i] = fma_f(acc_b[j][i], corr, p * vb[i]);
      }
    }
  }

  // merge the warps of this block: shared (m, l) per warp and row, then the outputs channel by channel
  __shared__ float s_ml[kWarps][kHeads][2];
  extern __shared__ float s_acc[];  // [kWarps][kHeads][d]
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kHeads; ++j) {
      s_ml[warp][j][0] = mx[j];
      s_ml[warp][j][1] = l[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kHeads; ++j) {
    if (j >= nh) continue;
#pragma unroll
    for (int i = 0; i < kSlots; ++i) {
      if (lane + 32 * i >= slots) continue;
      s_acc[(warp * kHeads + j) * d + ca[i]] = acc_a[j][i];
      s_acc[(warp * kHeads + j) * d + cb[i]] = acc_b[j][i];
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < nh * d; e += blockDim.x) {
    const int j = e / d, c = e % d;
    SoftmaxPartial total{-INFINITY, 0.0f};
    float out = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      SoftmaxPartial merged;
      float fa, fb;
      softmax_merge_factors(total, SoftmaxPartial{s_ml[w][j][0], s_ml[w][j][1]}, merged, fa, fb);
      out = out * fa + s_acc[(w * kHeads + j) * d + c] * fb;
      total = merged;
    }
    const int64_t at = q_row(j) * splits + split;
    part_acc[at * d + c] = out;
    if (c == 0) {
      part_ml[at * 2] = total.m;
      part_ml[at * 2 + 1] = total.l;
    }
  }
}

// out (rows, D): the splits of each query row merged in split order; sink_logits (Hq,): learned attention sinks
// of the rows' query heads, or nullptr.
__global__ void merge_splits_kernel(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                    const float* __restrict__ sink_logits, int64_t q_heads, int64_t rows,
                                    int64_t splits, int64_t d, float* __restrict__ out) {
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
      SoftmaxPartial total{-INFINITY, 0.0f};
      float o = 0.0f;
      for (int64_t s = 0; s < splits; ++s) {
        const float* ml = part_ml + (r * splits + s) * 2;
        SoftmaxPartial merged;
        float fa, fb;
        softmax_merge_factors(total, SoftmaxPartial{ml[0], ml[1]}, merged, fa, fb);
        o = o * fa + part_acc[(r * splits + s) * d + c] * fb;
        total = merged;
      }
      // no cached token: zero output; a NaN sum (NaN in a full-precision key) stays NaN, as on the CPU
      out[r * d + c] = o * softmax_normalizer(total, row_sink_logit(sink_logits, r, q_heads));
    }
  }
}

// Launches the split kernel for kHeads query rows per block and kSlots channel pairs per lane.
template <int kHeads, int kSlots>
void launch_split(AttentionCall& call, const dim3& grid, int64_t splits, at::Tensor& part_ml,
                  at::Tensor& part_acc, cudaStream_t stream) {
  const CacheGeometry& g = call.cache.g;
  const bool prefill = call.q_start.defined();
  const size_t smem = static_cast<size_t>(kWarps) * kHeads * g.dim * sizeof(float);  // <= 16 KiB
  RKV_DISPATCH_FLOAT(call.cache.fp, "rkv.attention", fp_t, [&] {
    RKV_DISPATCH_FLOAT(call.cache.meta, "rkv.attention", meta_t, [&] {
      const fp_t* kf = prefill ? call.k_fresh.const_data_ptr<fp_t>() : nullptr;
      const fp_t* vf = prefill ? call.v_fresh.const_data_ptr<fp_t>() : nullptr;
      attention_split_kernel<fp_t, meta_t, kHeads, kSlots><<<grid, kWarps * 32, smem, stream>>>(
          g, call.cache.pt, call.q.const_data_ptr<float>(), call.cache.lengths.const_data_ptr<int64_t>(),
          prefill ? call.q_start.const_data_ptr<int64_t>() : nullptr,
          Side<fp_t, meta_t>{call.cache.k, kf}, Side<fp_t, meta_t>{call.cache.v, vf},
          call.cos.defined() ? call.cos.const_data_ptr<float>() : nullptr,
          call.sin.defined() ? call.sin.const_data_ptr<float>() : nullptr, splits,
          part_ml.mutable_data_ptr<float>(), part_acc.mutable_data_ptr<float>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

// Runs the split kernel over every (split x row chunk, kv head, sequence) and merges: the output
// (query tokens, Hq, D) in fp32, still in the values' Hadamard space. Rows no sequence owns (prefill
// padding past query_start_loc[B]) keep zero partials and merge to zeros.
at::Tensor run_attention(AttentionCall& call) {
  const c10::cuda::CUDAGuard guard(call.q.device());
  CacheGeometry& g = call.cache.g;
  TORCH_CHECK_VALUE(g.dim <= 2 * 32 * kMaxSlots && g.dim % 2 == 0,
                    "rkv: head_dim must be even and <= 512 on CUDA (got ", g.dim, ")");
  TORCH_CHECK_VALUE(g.batch <= 65535, "rkv: at most 65535 sequences per call on CUDA (got ", g.batch, ")");
  const bool prefill = call.q_start.defined();
  const int64_t max_q = prefill ? call.max_query_len : 1;
  // the smallest kernel that holds the rows and channels: head_dim <= 128 takes 2 channel pairs a lane,
  // up to 8 rows a block (4 when a GQA group has no more); head_dim <= 256 takes 4 pairs and 4 rows, and
  // head_dim <= 512 8 pairs and 2 rows (the registers a lane holds: 4 x rows x pairs floats)
  const int slots = g.dim <= 128 ? 2 : g.dim <= 256 ? 4 : 8;
  const int heads = slots == 8 ? 2 : slots == 2 && g.group_size() * max_q > 4 ? 8 : 4;
  const int64_t row_chunks = std::max<int64_t>(1, (g.group_size() * max_q + heads - 1) / heads);
  // splits cover the tokens the tables address (not the data-dependent lengths): no host synchronization;
  // with a sliding window, the window and the chunk from each sequence's split_base
  const int64_t max_tokens = split_span(g.max_tokens(), max_q, g.sliding_window);
  if (g.split_tokens == 0) {
    // enough splits to fill the GPU a few times over, never more: the partial results (and the merge)
    // grow with the number of splits
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, call.q.device().index()));
    const int64_t blocks = std::max<int64_t>(1, g.batch * g.kv_heads * row_chunks);
    const int64_t wanted = std::max<int64_t>(1, (8 * sms + blocks - 1) / blocks);
    const int64_t by_default = (max_tokens + kDefaultSplit - 1) / kDefaultSplit;
    const int64_t splits = std::max<int64_t>(1, std::min(wanted, by_default));
    g.split_tokens = std::max<int64_t>(kDefaultSplit, (max_tokens + splits - 1) / splits);
  }
  const int64_t splits = std::max<int64_t>(1, (max_tokens + g.split_tokens - 1) / g.split_tokens);
  TORCH_CHECK_VALUE(g.kv_heads <= 65535, "rkv: at most 65535 kv heads on CUDA (got ", g.kv_heads, ")");
  TORCH_CHECK_VALUE(splits * row_chunks < (int64_t{1} << 31), "rkv: splits x query rows / ", heads, " (",
                    splits * row_chunks, ") must be below 2^31 on CUDA; split the chunk");
  const int64_t query_tokens = call.q.size(0);
  at::Tensor part_ml = at::zeros({query_tokens, g.q_heads, splits, 2}, call.q.options());
  at::Tensor part_acc = at::zeros({query_tokens, g.q_heads, splits, g.dim}, call.q.options());
  at::Tensor out = at::empty({query_tokens, g.q_heads, g.dim}, call.q.options());
  if (query_tokens == 0 || g.q_heads == 0) return out;
  const auto stream = c10::cuda::getCurrentCUDAStream();
  if (g.batch > 0) {
    const dim3 grid(static_cast<unsigned>(splits * row_chunks), static_cast<unsigned>(g.kv_heads),
                    static_cast<unsigned>(g.batch));
    if (slots == 8) {
      launch_split<2, 8>(call, grid, splits, part_ml, part_acc, stream);
    } else if (slots == 4) {
      launch_split<4, 4>(call, grid, splits, part_ml, part_acc, stream);
    } else if (heads == 8) {
      launch_split<8, 2>(call, grid, splits, part_ml, part_acc, stream);
    } else {
      launch_split<4, 2>(call, grid, splits, part_ml, part_acc, stream);
    }
  }
  const int64_t rows = query_tokens * g.q_heads;
  merge_splits_kernel<<<grid_for(rows, 1), 128, 0, stream>>>(
      part_ml.const_data_ptr<float>(), part_acc.const_data_ptr<float>(),
      call.sink_logits.defined() ? call.sink_logits.const_data_ptr<float>() : nullptr, g.q_heads, rows, splits, g.dim,
      out.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) {
  m.impl("decode_attention", &decode_attention_op<run_attention>);
  m.impl("paged_decode_attention", &paged_decode_attention_op<run_attention>);
  m.impl("paged_prefill_attention", &paged_prefill_attention_op<run_attention>);
}

}  // namespace rkv::cuda
