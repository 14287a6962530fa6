// Tree-verify attention in MLA absorbed form (spec verify_attention.md).
//
// All H heads share one latent KV head, so a request's D*H query rows (slot-major,
// row = i*H + h) are one matrix against one key matrix. A CTA takes a tile of
// ROWS query rows of one request and one split of its keys, streams the keys
// through shared memory in tiles of KEYS rows (cp.async, double buffered) and
// keeps an online softmax in float32:
//   warps 0-3: S = Q K^T for 16 rows each, scale, tree mask, softmax update,
//              P (bf16) and the row rescale factors to shared memory;
//   warps 0-7: O = alpha * O + P V, each warp 16 rows x 256 of the 512 columns.
// With one split the CTA writes out/lse; with several it writes float32
// partials that the combine kernel at the end of this file merges by their LSEs.
#include "mma.cuh"

namespace kd {
namespace {

constexpr int LD = QK_DIM + 8;      // padded row stride (elements): conflict-free ldmatrix
constexpr int CHUNKS = QK_DIM / 8;  // 16-byte chunks per cache row (72)
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

// Tile shape: SW softmax warps of 16 rows each; 2*SW warps in all (two column halves).
// Large: 64 rows x 32 keys, 155 KB of shared memory (Hopper, 227 KB per block).
// Small: 32 rows x 16 keys, 75 KB (sm_120 parts allow 99 KB per block).
template <int SW_, int KEYS_>
struct Tile {
  static constexpr int SW = SW_;
  static constexpr int KEYS = KEYS_;
  static constexpr int ROWS = 16 * SW;
  static constexpr int THREADS = 64 * SW;
  static constexpr int PLD = KEYS + 8;
  static constexpr size_t SMEM_Q = (size_t)ROWS * LD * 2;
  static constexpr size_t SMEM_KV = (size_t)KEYS * LD * 2;
  static constexpr size_t SMEM_P = (size_t)ROWS * PLD * 2;
  static constexpr size_t SMEM_BYTES = SMEM_Q + 2 * SMEM_KV + SMEM_P + 3 * ROWS * sizeof(float);
};
using TileLarge = Tile<4, 32>;
using TileSmall = Tile<2, 16>;

struct Params {
  const __nv_bfloat16* q;
  const __nv_bfloat16* kv;
  const int32_t* block_table;
  const int32_t* seq_lens;
  const void* vis;
  int vis_bits;
  int D, H, R, page_size, max_pages, num_splits;
  float scale_log2;  // softmax scale * log2(e)
  __nv_bfloat16* out;
  float* lse;
  float* part_out;
  float* part_lse;
};

__device__ __forceinline__ bool visible(const Params& p, int b, int i, int j) {
  if (p.vis_bits) {
    const int W = (p.D + 31) >> 5;
    const int32_t* w = static_cast<const int32_t*>(p.vis) + ((size_t)b * p.D + i) * W;
    return (w[j >> 5] >> (j & 31)) & 1;
  }
  return static_cast<const uint8_t*>(p.vis)[((size_t)b * p.D + i) * p.D + j] != 0;
}

// Async load of key rows [k0, k0 + KEYS) of request b into a tile; rows at or past
// `end` are zero-filled so no NaN from unused pages can reach P*V.
template <class T>
__device__ __forceinline__ void load_kv_tile(const Params& p, int b, int k0, int end,
                                             __nv_bfloat16* tile) {
  for (int c = threadIdx.x; c < T::KEYS * CHUNKS; c += T::THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const int pos = k0 + r;
    const __nv_bfloat16* src = p.kv;
    int bytes = 0;
    if (pos < end) {
      const int page = p.block_table[(size_t)b * p.max_pages + pos / p.page_size];
      src = p.kv + ((size_t)page * p.page_size + pos % p.page_size) * QK_DIM + col;
      bytes = 16;
    }
    cp_async16(tile + r * LD + col, src, bytes);
  }
}

template <class T>
__global__ void __launch_bounds__(T::THREADS, 1) verify_attention_kernel(Params p) {
  constexpr int ROWS = T::ROWS, KEYS = T::KEYS, THREADS = T::THREADS, SW = T::SW, PLD = T::PLD;
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* sQ = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* sKV0 = reinterpret_cast<__nv_bfloat16*>(smem + T::SMEM_Q);
  __nv_bfloat16* sP = reinterpret_cast<__nv_bfloat16*>(smem + T::SMEM_Q + 2 * T::SMEM_KV);
  float* sAlpha = reinterpret_cast<float*>(smem + T::SMEM_Q + 2 * T::SMEM_KV + T::SMEM_P);
  float* sM = sAlpha + ROWS;
  float* sL = sM + ROWS;

  const int m0 = blockIdx.x * ROWS, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  // Clamped to the block table so a bad length cannot read past it (the host cannot check
  // device-side lengths without a sync; the Python reference rejects them).
  const int seq = min(max(p.seq_lens[b], 0), p.max_pages * p.page_size);
  const int P = seq - p.D;  // prefix length; tree slots sit at positions P .. seq-1

  // This split's key range, in whole tiles.
  const int tiles_total = ceil_div(seq, KEYS);
  const int tiles_per = ceil_div(tiles_total, p.num_splits);
  const int k_begin = split * tiles_per * KEYS;
  const int k_end = min(seq, k_begin + tiles_per * KEYS);
  const int ntiles = k_end > k_begin ? ceil_div(k_end - k_begin, KEYS) : 0;

  // Q tile (rows past R zero-filled) and the first key tile.
  for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, col = (c % CHUNKS) * 8;
    const bool ok = m0 + r < p.R;
    const __nv_bfloat16* src = ok ? p.q + ((size_t)b * p.R + m0 + r) * QK_DIM + col : p.q;
    cp_async16(sQ + r * LD + col, src, ok ? 16 : 0);
  }
  if (ntiles > 0) load_kv_tile<T>(p, b, k_begin, k_end, sKV0);
  cp_async_commit();

  const int qrow = (warp % SW) * 16;   // this warp's 16 rows within the tile
  const int col0 = (warp / SW) * 256;  // this warp's output columns
  float o[32][4];
#pragma unroll
  for (int j = 0; j < 32; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // warps 0-3 only
  // Tree slot of this thread's two rows (g, g+8), for the mask.
  const int slot0 = (m0 + qrow + g) / p.H, slot1 = (m0 + qrow + g + 8) / p.H;

  for (int it = 0; it < ntiles; ++it) {
    const int k0 = k_begin + it * KEYS;
    if (it + 1 < ntiles)
      load_kv_tile<T>(p, b, k0 + KEYS, k_end, sKV0 + ((it + 1) & 1) * KEYS * LD);
    cp_async_commit();
    cp_async_wait<1>();
    __syncthreads();
    const __nv_bfloat16* sK = sKV0 + (it & 1) * KEYS * LD;

    if (warp < SW) {
      constexpr int NT = KEYS / 8;  // n-tiles of 8 keys
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < QK_DIM / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, sQ + (qrow + (lane & 7) + 8 * ((lane >> 3) & 1)) * LD + kk * 16 +
                           8 * (lane >> 4));
#pragma unroll
        for (int jp = 0; jp < NT / 2; ++jp) {
          uint32_t bb[4];
          const int mi = lane >> 3;
          ldmatrix_x4(bb, sK + (jp * 16 + (lane & 7) + 8 * (mi >> 1)) * LD + kk * 16 +
                              8 * (mi & 1));
          mma_bf16(s[2 * jp], a, bb[0], bb[1]);
          mma_bf16(s[2 * jp + 1], a, bb[2], bb[3]);
        }
      }
      // Scale into the log2 domain and mask: keys past the range, and tree keys the
      // slot does not see (ancestors and itself only).
      float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + j * 8 + 2 * t + (e & 1);
          const int slot = e < 2 ? slot0 : slot1;
          bool ok = key < k_end;
          if (ok && key >= P) ok = slot < p.D && visible(p, b, slot, key - P);
          s[j][e] = ok ? s[j][e] * p.scale_log2 : -INFINITY;
          mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
        }
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      }
      float alpha[2], msafe[2], sum[2] = {0.f, 0.f};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float m_new = fmaxf(m_run[h], mx[h]);
        msafe[h] = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep zeros
        alpha[h] = exp2f(m_run[h] - msafe[h]);
        m_run[h] = m_new;
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float p0 = exp2f(s[j][0] - msafe[0]), p1 = exp2f(s[j][1] - msafe[0]);
        const float p2 = exp2f(s[j][2] - msafe[1]), p3 = exp2f(s[j][3] - msafe[1]);
        sum[0] += p0 + p1;
        sum[1] += p2 + p3;
        const int c = j * 8 + 2 * t;
        *reinterpret_cast<uint32_t*>(sP + (qrow + g) * PLD + c) = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t*>(sP + (qrow + g + 8) * PLD + c) = pack_bf16(p2, p3);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        l_run[h] = l_run[h] * alpha[h] + sum[h];
      }
      if (t == 0) { sAlpha[qrow + g] = alpha[0]; sAlpha[qrow + g + 8] = alpha[1]; }
    }
    __syncthreads();

    // O = alpha * O + P V over this warp's 256 columns.
    const float a0 = sAlpha[qrow + g], a1 = sAlpha[qrow + g + 8];
#pragma unroll
    for (int j = 0; j < 32; ++j) { o[j][0] *= a0; o[j][1] *= a0; o[j][2] *= a1; o[j][3] *= a1; }
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, sP + (qrow + (lane & 7) + 8 * ((lane >> 3) & 1)) * PLD + kk * 16 +
                         8 * (lane >> 4));
#pragma unroll
      for (int jp = 0; jp < 16; ++jp) {
        uint32_t bb[4];
        const int mi = lane >> 3;
        ldmatrix_x4_trans(bb, sK + (kk * 16 + (lane & 7) + 8 * (mi & 1)) * LD + col0 + jp * 16 +
                                  8 * (mi >> 1));
        mma_bf16(o[2 * jp], a, bb[0], bb[1]);
        mma_bf16(o[2 * jp + 1], a, bb[2], bb[3]);
      }
    }
    __syncthreads();  // the tile buffer is overwritten by the next iteration's load
  }
  cp_async_wait<0>();

  if (warp < SW && t == 0) {
    sM[qrow + g] = m_run[0]; sM[qrow + g + 8] = m_run[1];
    sL[qrow + g] = l_run[0]; sL[qrow + g + 8] = l_run[1];
  }
  __syncthreads();

  const bool direct = p.num_splits == 1;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = qrow + g + 8 * h;
    const int row = m0 + r;
    if (row >= p.R) continue;
    const float l = sL[r], m = sM[r];
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const float lse = l > 0.f ? (m + log2f(l)) * LN2 : -INFINITY;
    if (direct) {
      __nv_bfloat16* dst = p.out + ((size_t)b * p.R + row) * V_DIM + col0 + 2 * t;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<uint32_t*>(dst + j * 8) = pack_bf16(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      if (warp < SW && t == 0) p.lse[(size_t)b * p.R + row] = lse;
    } else {
      const size_t prow = ((size_t)b * p.num_splits + split) * p.R + row;
      float* dst = p.part_out + prow * V_DIM + col0 + 2 * t;
#pragma unroll
      for (int j = 0; j < 32; ++j)
        *reinterpret_cast<float2*>(dst + j * 8) = make_float2(o[j][2 * h] * inv, o[j][2 * h + 1] * inv);
      if (warp < SW && t == 0) p.part_lse[prow] = lse;
    }
  }
}

// Merge the splits of each row by their LSEs: out = sum_s exp(lse_s - lse) * o_s.
__global__ void verify_combine_kernel(const float* __restrict__ part_out,
                                      const float* __restrict__ part_lse, int R, int num_splits,
                                      __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  const int row = blockIdx.x, b = blockIdx.y;
  float m = -INFINITY;
  for (int s = 0; s < num_splits; ++s)
    m = fmaxf(m, part_lse[((size_t)b * num_splits + s) * R + row]);
  float total = 0.f;
  for (int s = 0; s < num_splits; ++s) {
    const float l = part_lse[((size_t)b * num_splits + s) * R + row];
    total += l == -INFINITY ? 0.f : exp2f((l - m) * LOG2E);
  }
  const float lse_all = total > 0.f ? m + logf(total) : -INFINITY;
  // 128 threads x 4 columns
  const int c = threadIdx.x * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s = 0; s < num_splits; ++s) {
    const size_t prow = ((size_t)b * num_splits + s) * R + row;
    const float l = part_lse[prow];
    if (l == -INFINITY) continue;
    const float w = exp2f((l - lse_all) * LOG2E);
    const float4 v = *reinterpret_cast<const float4*>(part_out + prow * V_DIM + c);
    acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
  }
  __nv_bfloat16* dst = out + ((size_t)b * R + row) * V_DIM + c;
  *reinterpret_cast<uint32_t*>(dst) = pack_bf16(acc.x, acc.y);
  *reinterpret_cast<uint32_t*>(dst + 2) = pack_bf16(acc.z, acc.w);
  if (threadIdx.x == 0) lse[(size_t)b * R + row] = lse_all;
}

}  // namespace
}  // namespace kd

namespace kd {
namespace {

// The largest tile whose shared memory fits this device's per-block limit.
bool use_large_tile(int* err) {
  int dev = 0, optin = 0;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  *err = (int)e;
  return (size_t)optin >= TileLarge::SMEM_BYTES;
}

template <class T>
int launch(const Params& p, int B, cudaStream_t st) {
  cudaError_t e = cudaFuncSetAttribute(verify_attention_kernel<T>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)T::SMEM_BYTES);
  if (e != cudaSuccess) return (int)e;
  dim3 grid(ceil_div(p.R, T::ROWS), p.num_splits, B);
  verify_attention_kernel<T><<<grid, T::THREADS, T::SMEM_BYTES, st>>>(p);
  KD_LAUNCH_CHECK();
  return 0;
}

}  // namespace
}  // namespace kd

extern "C" int kd_verify_tile(int* rows_per_cta, int* keys_per_tile) {
  int err = 0;
  const bool large = kd::use_large_tile(&err);
  *rows_per_cta = large ? kd::TileLarge::ROWS : kd::TileSmall::ROWS;
  *keys_per_tile = large ? kd::TileLarge::KEYS : kd::TileSmall::KEYS;
  return err;
}

extern "C" int kd_verify_attention(const void* q, const void* kv_cache, const int32_t* block_table,
                                   const int32_t* seq_lens, const void* visibility, int vis_bits,
                                   int B, int D, int H, int page_size, int max_pages, float scale,
                                   int num_splits, void* out, float* lse, float* partial_out,
                                   float* partial_lse, void* stream) {
  if (B < 0 || D < 1 || H < 1 || page_size < 1 || max_pages < 1 || num_splits < 1)
    return KD_ERR_ARGUMENT;
  if (num_splits > 1 && (!partial_out || !partial_lse)) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  kd::Params p;
  p.q = static_cast<const __nv_bfloat16*>(q);
  p.kv = static_cast<const __nv_bfloat16*>(kv_cache);
  p.block_table = block_table;
  p.seq_lens = seq_lens;
  p.vis = visibility;
  p.vis_bits = vis_bits;
  p.D = D; p.H = H; p.R = D * H;
  p.page_size = page_size; p.max_pages = max_pages; p.num_splits = num_splits;
  p.scale_log2 = scale * kd::LOG2E;
  p.out = static_cast<__nv_bfloat16*>(out);
  p.lse = lse;
  p.part_out = partial_out;
  p.part_lse = partial_lse;
  cudaStream_t st = (cudaStream_t)stream;
  int err = 0;
  const bool large = kd::use_large_tile(&err);
  if (err) return err;
  const int rc = large ? kd::launch<kd::TileLarge>(p, B, st) : kd::launch<kd::TileSmall>(p, B, st);
  if (rc) return rc;
  if (num_splits > 1) {
    kd::verify_combine_kernel<<<dim3(p.R, B), 128, 0, st>>>(partial_out, partial_lse, p.R,
                                                             num_splits, p.out, lse);
    KD_LAUNCH_CHECK();
  }
  return 0;
}
