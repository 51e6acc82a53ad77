// CUDA kernel of rkv::decode_attention (flash-decoding over the quantized cache).
//
// Grid (split, kv head x head chunk, sequence); 4 warps per block. Each warp walks every 4th token of
// the block's split; its 32 lanes each own up to 4 channel pairs ("slots") of head_dim <= 256, chosen
// so that a lane holds both members of its RoPE pairs. Per token a lane reads its codes once from the
// packed row, dequantizes and rotates them in registers (include/rkv/*.h, the CPU kernel's arithmetic),
// the warp reduces the dot products for up to 8 query heads of the GQA group, and keeps an online
// softmax and the output in registers. The warps of a block are merged in shared memory, the splits of
// a sequence by a second kernel in split order.
#include "../op_common.h"
#include "common.cuh"
#include "rkv/attention.h"
#include "rkv/pack.h"
#include "rkv/quant.h"
#include "rkv/rope.h"

namespace rkv::cuda {
namespace {

constexpr int kWarps = 4;
constexpr int kMaxHeads = 8;  // query heads per block; larger GQA groups use more blocks
constexpr int kMaxSlots = 4;  // channel pairs per lane: head_dim <= 2 * 32 * 4 = 256
constexpr int64_t kDefaultSplit = 128;

// The two channels of a lane's slot p: RoPE pairs when keys are rotated, neighbours otherwise.
__device__ __forceinline__ void slot_channels(int64_t p, int64_t half, bool interleaved, int64_t& a, int64_t& b) {
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

// One cached tensor (keys or values) for all sequences and heads.
template <typename fp_t, typename meta_t>
struct Side {
  const uint8_t* packed;  // (B*Hkv, C, D*bits/8)
  const meta_t* scale;    // (B*Hkv, C/T, D/G)
  const meta_t* zero;     // same or nullptr
  const fp_t* window;     // (B*Hkv, W, D)
  const fp_t* sink;       // (B*Hkv, S, D)
  int64_t block_tokens, group;
  int bits;

  __device__ float2 load(const DecodeGeometry& g, int64_t bh, int64_t t, int64_t q_count, int64_t a, int64_t b) const {
    const int64_t d = g.dim;
    switch (token_place(t, g.sinks, q_count)) {
      case Place::Sink: {
        const fp_t* row = sink + (bh * g.sinks + t) * d;
        return make_float2(static_cast<float>(row[a]), static_cast<float>(row[b]));
      }
      case Place::Window: {
        const fp_t* row = window + (bh * g.window + window_slot(t, g.sinks, g.window)) * d;
        return make_float2(static_cast<float>(row[a]), static_cast<float>(row[b]));
      }
      default: {
        const int64_t s = t - g.sinks, rb = d * bits / 8, ng = d / group;
        const uint8_t* row = packed + (bh * g.capacity + s) * rb;
        const int64_t meta = (bh * (g.capacity / block_tokens) + s / block_tokens) * ng;
        const bool sym = zero == nullptr;
        const QParams pa{static_cast<float>(scale[meta + a / group]), sym ? 0.0f : static_cast<float>(zero[meta + a / group])};
        const QParams pb{static_cast<float>(scale[meta + b / group]), sym ? 0.0f : static_cast<float>(zero[meta + b / group])};
        return make_float2(decode(unpack_code(row, a, bits), pa, bits, sym), decode(unpack_code(row, b, bits), pb, bits, sym));
      }
    }
  }
};

template <typename fp_t, typename meta_t>
__global__ void __launch_bounds__(kWarps * 32)
    decode_split_kernel(DecodeGeometry g, const float* __restrict__ q, const int64_t* __restrict__ lengths,
                        Side<fp_t, meta_t> keys, Side<fp_t, meta_t> values, const float* __restrict__ cos,
                        const float* __restrict__ sin, int64_t splits, float* __restrict__ part_ml,
                        float* __restrict__ part_acc) {
  const int64_t split = blockIdx.x, b = blockIdx.z;
  const int64_t chunks = (g.group_size() + kMaxHeads - 1) / kMaxHeads;
  const int64_t h = blockIdx.y / chunks, head0 = (blockIdx.y % chunks) * kMaxHeads;
  const int64_t left = g.group_size() - head0;
  const int nh = static_cast<int>(left < kMaxHeads ? left : kMaxHeads);
  const int64_t bh = b * g.kv_heads + h, hq0 = b * g.q_heads + h * g.group_size() + head0;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t d = g.dim, n = lengths[b];
  CUDA_KERNEL_ASSERT_MSG(n >= 0 && n <= g.max_tokens(), "rkv.decode_attention: lengths beyond the cache capacity");
  CUDA_KERNEL_ASSERT_MSG(g.rope_half == 0 || n <= g.rope_positions,
                         "rkv.decode_attention: lengths beyond the rope_cos / rope_sin table");
  const int64_t t0 = split * g.split_tokens, t1 = n < t0 + g.split_tokens ? n : t0 + g.split_tokens;
  const int64_t q_count = quantized_count(n, g.sinks, g.recent, g.block);
  const int64_t slots = d / 2;

  // this lane's channels and query values
  int64_t ca[kMaxSlots], cb[kMaxSlots];
  float qa[kMaxHeads][kMaxSlots], qb[kMaxHeads][kMaxSlots];
#pragma unroll
  for (int i = 0; i < kMaxSlots; ++i) {
    const int64_t p = lane + 32 * i;
    ca[i] = cb[i] = 0;
    if (p < slots) slot_channels(p, g.rope_half, g.interleaved, ca[i], cb[i]);
#pragma unroll
    for (int j = 0; j < kMaxHeads; ++j) {
      const bool on = p < slots && j < nh;
      qa[j][i] = on ? q[(hq0 + j) * d + ca[i]] : 0.0f;
      qb[j][i] = on ? q[(hq0 + j) * d + cb[i]] : 0.0f;
    }
  }

  float m[kMaxHeads], l[kMaxHeads], acc_a[kMaxHeads][kMaxSlots], acc_b[kMaxHeads][kMaxSlots];
#pragma unroll
  for (int j = 0; j < kMaxHeads; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < kMaxSlots; ++i) acc_a[j][i] = acc_b[j][i] = 0.0f;
  }

  for (int64_t t = t0 + warp; t < t1; t += kWarps) {
    float ka[kMaxSlots], kb[kMaxSlots];
#pragma unroll
    for (int i = 0; i < kMaxSlots; ++i) {
      const int64_t p = lane + 32 * i;
      ka[i] = kb[i] = 0.0f;
      if (p >= slots) continue;
      const float2 k2 = keys.load(g, bh, t, q_count, ca[i], cb[i]);
      ka[i] = k2.x;
      kb[i] = k2.y;
      if (cos != nullptr && p < g.rope_half) rope_apply(ka[i], kb[i], cos[t * g.rope_half + p], sin[t * g.rope_half + p]);
    }
    float score[kMaxHeads];
#pragma unroll
    for (int j = 0; j < kMaxHeads; ++j) {
      score[j] = 0.0f;
      if (j >= nh) continue;  // warp-uniform
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kMaxSlots; ++i) partial = fma_f(qa[j][i], ka[i], fma_f(qb[j][i], kb[i], partial));
      score[j] = warp_sum(partial);
    }
    float va[kMaxSlots], vb[kMaxSlots];
#pragma unroll
    for (int i = 0; i < kMaxSlots; ++i) {
      va[i] = vb[i] = 0.0f;
      if (lane + 32 * i >= slots) continue;
      const float2 v2 = values.load(g, bh, t, q_count, ca[i], cb[i]);
      va[i] = v2.x;
      vb[i] = v2.y;
    }
#pragma unroll
    for (int j = 0; j < kMaxHeads; ++j) {
      if (j >= nh) continue;
      const float m_new = fmaxf(m[j], score[j]);
      // -inf guards: the first token (m = -inf) and a -inf score (an infinite key) weigh 0, not NaN
      const float corr = m[j] == -INFINITY ? 0.0f : softmax_exp(m[j] - m_new);
      const float p = m_new == -INFINITY ? 0.0f : softmax_exp(score[j] - m_new);
      l[j] = fma_f(l[j], corr, p);
      m[j] = m_new;
#pragma unroll
      for (int i = 0; i < kMaxSlots; ++i) {
        acc_a[j][i] = fma_f(acc_a[j][i], corr, p * va[i]);
        acc_b[j][i] = fma_f(acc_b[j][i], corr, p * vb[i]);
      }
    }
  }

  // merge the warps of this block: shared (m, l) per warp and head, then the outputs channel by channel
  __shared__ float s_ml[kWarps][kMaxHeads][2];
  extern __shared__ float s_acc[];  // [kWarps][kMaxHeads][d]
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < kMaxHeads; ++j) {
      s_ml[warp][j][0] = m[j];
      s_ml[warp][j][1] = l[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kMaxHeads; ++j) {
    if (j >= nh) continue;
#pragma unroll
    for (int i = 0; i < kMaxSlots; ++i) {
      if (lane + 32 * i >= slots) continue;
      s_acc[(warp * kMaxHeads + j) * d + ca[i]] = acc_a[j][i];
      s_acc[(warp * kMaxHeads + j) * d + cb[i]] = acc_b[j][i];
    }
  }
  __syncthreads();
  for (int64_t e = threadIdx.x; e < nh * d; e += blockDim.x) {
    const int j = static_cast<int>(e / d);
    const int64_t c = e % d;
    SoftmaxPartial total{-INFINITY, 0.0f};
    float out = 0.0f;
    for (int w = 0; w < kWarps; ++w) {
      SoftmaxPartial merged;
      float fa, fb;
      softmax_merge_factors(total, SoftmaxPartial{s_ml[w][j][0], s_ml[w][j][1]}, merged, fa, fb);
      out = out * fa + s_acc[(w * kMaxHeads + j) * d + c] * fb;
      total = merged;
    }
    const int64_t slot = (hq0 + j) * splits + split;
    part_acc[slot * d + c] = out;
    if (c == 0) {
      part_ml[slot * 2] = total.m;
      part_ml[slot * 2 + 1] = total.l;
    }
  }
}

// out (B*Hq, D): the splits of each query head merged in split order.
__global__ void merge_splits_kernel(const float* __restrict__ part_ml, const float* __restrict__ part_acc,
                                    int64_t rows, int64_t splits, int64_t d, float* __restrict__ out) {
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
      out[r * d + c] = o * (total.l > 0.0f ? 1.0f / total.l : 0.0f);
    }
  }
}

template <typename fp_t, typename meta_t>
Side<fp_t, meta_t> side(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& zero,
                        const at::Tensor& window, const at::Tensor& sink, int64_t block_tokens, int64_t group,
                        int bits) {
  return Side<fp_t, meta_t>{packed.const_data_ptr<uint8_t>(), scale.const_data_ptr<meta_t>(),
                            zero.defined() ? zero.const_data_ptr<meta_t>() : nullptr, window.const_data_ptr<fp_t>(),
                            sink.const_data_ptr<fp_t>(), block_tokens, group, bits};
}

at::Tensor decode_attention_cuda(const at::Tensor& q, const at::Tensor& k_packed, const at::Tensor& k_scale,
                                 const std::optional<at::Tensor>& k_zero, const at::Tensor& v_packed,
                                 const at::Tensor& v_scale, const std::optional<at::Tensor>& v_zero,
                                 const at::Tensor& k_window, const at::Tensor& v_window, const at::Tensor& k_sink,
                                 const at::Tensor& v_sink, const at::Tensor& lengths, int64_t k_bits, int64_t v_bits,
                                 int64_t block, int64_t recent, const std::optional<at::Tensor>& rope_cos,
                                 const std::optional<at::Tensor>& rope_sin, bool rope_interleaved,
                                 const std::optional<at::Tensor>& k_signs, const std::optional<at::Tensor>& v_signs,
                                 double scale, int64_t split_tokens) {
  DecodeGeometry g = check_decode_attention(q, k_packed, k_scale, k_zero, v_packed, v_scale, v_zero, k_window, v_window,
                                            k_sink, v_sink, lengths, k_bits, v_bits, block, recent, rope_cos,
                                            rope_sin, rope_interleaved, k_signs, v_signs, split_tokens);
  TORCH_CHECK_VALUE(g.dim <= 2 * 32 * kMaxSlots && g.dim % 2 == 0,
                    "rkv.decode_attention: head_dim must be even and <= 256 on CUDA (got ", g.dim, ")");
  TORCH_CHECK_VALUE(g.batch <= 65535, "rkv.decode_attention: at most 65535 sequences per call on CUDA (got ",
                    g.batch, ")");
  if (split_tokens == 0) {
    // enough splits to fill the GPU a few times over, never more: the partial results (and the merge)
    // grow with the number of splits, which follows the capacity, not the lengths
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, q.device().index()));
    const int64_t chunks = (g.group_size() + kMaxHeads - 1) / kMaxHeads;
    const int64_t wanted = std::max<int64_t>(1, (8 * sms + g.batch * g.kv_heads * chunks - 1) /
                                                    std::max<int64_t>(1, g.batch * g.kv_heads * chunks));
    const int64_t by_default = (g.max_tokens() + kDefaultSplit - 1) / kDefaultSplit;
    const int64_t splits = std::max<int64_t>(1, std::min(wanted, by_default));
    g.split_tokens = std::max<int64_t>(kDefaultSplit, (g.max_tokens() + splits - 1) / splits);
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const at::Tensor len = lengths.to(at::kLong).contiguous();
  const at::Tensor qf = decode_query(q, scale, k_signs);
  const at::Tensor cos = rope_cos.has_value() ? rope_cos->to(at::kFloat).contiguous() : at::Tensor();
  const at::Tensor sin = rope_sin.has_value() ? rope_sin->to(at::kFloat).contiguous() : at::Tensor();
  // splits cover the capacity (not the data-dependent lengths): no host synchronization
  const int64_t splits = std::max<int64_t>(1, (g.max_tokens() + g.split_tokens - 1) / g.split_tokens);
  at::Tensor part_ml = at::empty({g.batch, g.q_heads, splits, 2}, qf.options());
  at::Tensor part_acc = at::empty({g.batch, g.q_heads, splits, g.dim}, qf.options());
  at::Tensor out = at::empty({g.batch, g.q_heads, g.dim}, qf.options());
  if (g.batch > 0 && g.q_heads > 0) {
    const auto c = [](const at::Tensor& t) { return t.contiguous(); };
    const at::Tensor kz = k_zero.has_value() ? c(*k_zero) : at::Tensor();
    const at::Tensor vz = v_zero.has_value() ? c(*v_zero) : at::Tensor();
    const at::Tensor kp = c(k_packed), ks = c(k_scale), vp = c(v_packed), vs = c(v_scale);
    const at::Tensor kw = c(k_window), vw = c(v_window), kk = c(k_sink), vk = c(v_sink);
    const int64_t chunks = (g.group_size() + kMaxHeads - 1) / kMaxHeads;
    const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(g.kv_heads * chunks),
                    static_cast<unsigned>(g.batch));
    const size_t smem = static_cast<size_t>(kWarps) * kMaxHeads * g.dim * sizeof(float);  // <= 32 KiB
    RKV_DISPATCH_FLOAT(k_window.scalar_type(), "rkv.decode_attention", fp_t, [&] {
      RKV_DISPATCH_FLOAT(k_scale.scalar_type(), "rkv.decode_attention", meta_t, [&] {
        decode_split_kernel<fp_t, meta_t><<<grid, kWarps * 32, smem, stream>>>(
            g, qf.const_data_ptr<float>(), len.const_data_ptr<int64_t>(),
            side<fp_t, meta_t>(kp, ks, kz, kw, kk, g.k_block_tokens, g.k_group, g.k_bits),
            side<fp_t, meta_t>(vp, vs, vz, vw, vk, g.v_block_tokens, g.v_group, g.v_bits),
            cos.defined() ? cos.const_data_ptr<float>() : nullptr, sin.defined() ? sin.const_data_ptr<float>() : nullptr,
            splits, part_ml.mutable_data_ptr<float>(), part_acc.mutable_data_ptr<float>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
    const int64_t rows = g.batch * g.q_heads;
    merge_splits_kernel<<<grid_for(rows, 1), 128, 0, stream>>>(part_ml.const_data_ptr<float>(),
                                                               part_acc.const_data_ptr<float>(), rows, splits, g.dim,
                                                               out.mutable_data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  return decode_output(out, v_signs, q.scalar_type());
}

}  // namespace

TORCH_LIBRARY_IMPL(rkv, CUDA, m) { m.impl("decode_attention", &decode_attention_cuda); }

}  // namespace rkv::cuda
