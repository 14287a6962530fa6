// Tree-verify attention on Hopper tensor cores (wgmma; this file is built for sm_90a only).
//
// Same contract as the mma.sync kernel in ../verify_attention.cu (one CTA = 64 query rows
// of one request x one split of its keys, online softmax in float32, partials for the
// combine kernel), but the operands stay in shared memory: wgmma reads Q, the key tile
// and P straight from 128-byte-swizzled tiles, so no ldmatrix traffic through registers
// (the mma.sync kernel's limit, kernels/NOTES.md). The two warpgroups have roles:
//   warpgroup 0: S = Q K^T for all 64 keys of the tile (m64n64k16 x 36) and the softmax
//                (whole rows in its registers: no max exchange), P and the rescale
//                factors to shared memory;
//   warpgroup 1: streams the next key tile in meanwhile (cp.async);
//   both:        O += P V, warpgroup w owning value columns 256w..256w+255 (m64n256k16 x 4,
//                P from shared memory, V = the key tile read MN-major: no copy, no transpose).
// PV of a tile overlaps S of the next (named barriers hand the buffers over). Tiles: [9 column blocks][rows][64 bf16] with 128-byte rows, the
// 16-byte chunk index XOR-ed with row % 8 (the canonical SW128 layout; 1024-byte bases).
#include "../mma.cuh"
#include "../verify_common.cuh"
#include "wgmma.cuh"

namespace kd {
namespace {

constexpr int ROWS = WGMMA_ROWS;           // one wgmma M
constexpr int KEYS = WGMMA_KEYS;
constexpr int THREADS = 256;               // two warpgroups
constexpr int CHUNKS = QK_DIM / 8;         // 16-byte chunks per cache row (72)
constexpr int BLOCK_BYTES = 128;           // one swizzled row: 64 bf16
constexpr int Q_BYTES = QK_DIM / 64 * ROWS * BLOCK_BYTES;   // 73,728
constexpr int KV_BYTES = QK_DIM / 64 * KEYS * BLOCK_BYTES;  // 73,728
constexpr int P_BYTES = ROWS * KEYS * 2;                    // 8,192
constexpr int STAGES = 2;
constexpr size_t SMEM_BYTES = 1024 /* alignment slack */ + Q_BYTES + STAGES * KV_BYTES + P_BYTES +
                              4 * ROWS * sizeof(float);     // 231,424 of Hopper's 232,448

// Byte offset of 16-byte chunk `chunk` (0..71) of row `row` in a swizzled tile of `rows`.
__device__ __forceinline__ uint32_t sw128_offset(int rows, int row, int chunk) {
  return (chunk >> 3) * rows * BLOCK_BYTES + row * BLOCK_BYTES + (((chunk & 7) ^ (row & 7)) << 4);
}

// Keys [k0, k0 + 64) of request b into a swizzled tile, by warpgroup 1; rows at or past
// `end` zero-filled (no NaN from unused pages can reach P*V). Its warp w takes rows
// 16w..16w+15: the first 16 lanes look their pages up at once, then per row lane l copies
// chunks l, l + 32 and (l < 8) l + 64, so the swizzle is a compile-time XOR per row.
__device__ __forceinline__ void load_keys(const VerifyParams& p, const int32_t* table, int k0, int end,
                                          uint32_t tile, int w) {
  const int lane = threadIdx.x & 31, r0 = w * 16;
  size_t row_off = 0;
  int row_ok = 0;
  if (lane < 16 && k0 + r0 + lane < end) {
    row_off = cache_row(p, table, k0 + r0 + lane);
    row_ok = 1;
  }
#pragma unroll
  for (int r = 0; r < 16; ++r) {
    const size_t off = __shfl_sync(0xffffffffu, row_off, r);
    const int bytes = __shfl_sync(0xffffffffu, row_ok, r) ? 16 : 0;
    const __nv_bfloat16* src = p.kv + off + lane * 8;
    const uint32_t dst = tile + (r0 + r) * BLOCK_BYTES;
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      const int c = lane + 32 * i;  // (r0 + r) % 8 == r % 8
      if (i < 2 || lane < 8)
        cp_async16_s(dst + (c >> 3) * KEYS * BLOCK_BYTES + (((c & 7) ^ (r & 7)) << 4), src + 32 * 8 * i, bytes);
    }
  }
}

__global__ void __launch_bounds__(THREADS, 1) verify_attention_wgmma_kernel(VerifyParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ unsigned char smem_raw[];
  const uint32_t raw = smem_addr(smem_raw);
  const uint32_t sQ = (raw + 1023) & ~1023u;  // swizzle atoms repeat every 1024 bytes
  const uint32_t sKV = sQ + Q_BYTES, sP = sKV + STAGES * KV_BYTES;
  unsigned char* gP = smem_raw + (sP - raw);
  float* sAlpha = reinterpret_cast<float*>(gP + P_BYTES);  // per row, this tile's rescale
  float* sL = sAlpha + ROWS;                                // per row, at the end: sum, max
  float* sM = sL + ROWS;

  const int m0 = blockIdx.x * ROWS, split = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int rbase = (warp & 3) * 16;      // this warp's 16 rows of the 64
  const int32_t* table = p.block_table + (size_t)b * p.max_pages;
  const SplitKeys ks = split_keys(p, b, split, KEYS);  // this split's keys, in whole tiles
  const int P = ks.P, k_begin = ks.begin, k_end = ks.end, ntiles = ks.ntiles;
  const int unmasked_end = min(P, k_end);  // keys below this need no mask

  // Q (rows past R zero-filled) by all threads, key tile 0 by warpgroup 1: one group.
  for (int c = tid; c < ROWS * CHUNKS; c += THREADS) {
    const int r = c / CHUNKS, ch = c - r * CHUNKS;
    const bool ok = m0 + r < p.R;
    const __nv_bfloat16* src = ok ? p.q + ((size_t)b * p.R + m0 + r) * QK_DIM + ch * 8 : p.q;
    cp_async16_s(sQ + sw128_offset(ROWS, r, ch), src, ok ? 16 : 0);
  }
  if (wg == 1 && ntiles > 0) load_keys(p, table, k_begin, k_end, sKV, warp - 4);
  cp_async_commit();

  float o[128];  // wgmma's accumulator order: o[4j + e] is element e of 8-column block j
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  const auto o_at = [&](int j, int e) -> float& { return o[4 * j + e]; };
  float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};  // warpgroup 0's rows
  const int slot0 = (m0 + rbase + g) / p.H, slot1 = (m0 + rbase + g + 8) / p.H;

  // The tiles flow through a pipeline: PV of tile i is issued without waiting, so the
  // tensor cores go on from warpgroup 1's PV(i) to S(i+1). Named barriers (ids 1-3, both
  // warpgroups) hand the shared buffers over:
  //   P_READY (1): warpgroup 0 wrote P(i) and the rescale factors;
  //   KV_FREE (2): warpgroup 0's PV(i-1) finished, so tile i-1's slot may be refilled
  //                (arrived after the barrier that starts tile i, so an arrival can
  //                never be counted for the previous tile's);
  //   P_FREE  (3): warpgroup 1's PV(i-1) finished, so P may be overwritten.
  constexpr int P_READY = 1, KV_FREE = 2, P_FREE = 3;
  for (int it = 0; it < ntiles; ++it) {
    cp_async_wait<0>();
    fence_proxy_async();
    __syncthreads();  // tile `it` landed (and both PVs of tile it-1 are issued)
    const uint32_t sK = sKV + (it & 1) * KV_BYTES;
    float alpha[2];
    if (wg == 0) {
      // S = Q K^T: 36 k-steps of 16 columns; within a 128-byte row a step is +32 bytes.
      float s[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) s[i] = 0.f;
      // PV(it-1) must finish before its key slot is refilled; waiting for it here, not
      // after S(it), starts the next tile's copy ~1,000 cycles sooner (measured: 69 -> 74%
      // of roofline at H 8, D 64, P 32k, B 16). wait_group 1 after S would overlap more,
      // but ptxas then serialises every wgmma (45%).
      wgmma_wait<0>();
      named_arrive(KV_FREE, THREADS);
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < QK_DIM / 16; ++kk) {
        const uint32_t col = kk >> 2, step = (kk & 3) * 32;
        wgmma_m64n64k16(s, sw128_desc(sQ + col * ROWS * BLOCK_BYTES + step, 16, 1024),
                        sw128_desc(sK + col * KEYS * BLOCK_BYTES + step, 16, 1024), kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(s);
      reg_fence(o);

      // Mask keys past the range and tree keys the slot does not see (prefix tiles skip
      // the lookups). Raw scores: the scale (> 0) is folded into the exponent's FFMA.
      const int k0 = k_begin + it * KEYS;
      if (k0 + KEYS > unmasked_end) {
#pragma unroll
        for (int i = 0; i < 32; ++i) {
          const int key = k0 + (i >> 2) * 8 + 2 * t + (i & 1);
          const int slot = (i & 2) ? slot1 : slot0;
          bool ok = key < k_end;
          if (ok && key >= P) ok = slot < p.D && visible(p, b, slot, key - P);
          if (!ok) s[i] = -INFINITY;
        }
      }
      // Row maxima as trees (not a 16-long dependent chain): rows g (h = 0) and g + 8.
      float msafe[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float m8[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) m8[j] = fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]);
#pragma unroll
        for (int w = 4; w > 0; w >>= 1)
#pragma unroll
          for (int j = 0; j < w; ++j) m8[j] = fmaxf(m8[j], m8[j + w]);
        float mx = fmaxf(m8[0], __shfl_xor_sync(0xffffffffu, m8[0], 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2)) * p.scale_log2;
        const float m_new = fmaxf(m_run[h], mx);
        msafe[h] = m_new == -INFINITY ? 0.f : m_new;  // fully masked so far: keep zeros
        alpha[h] = exp2f(m_run[h] - msafe[h]);
        m_run[h] = m_new;
      }
      named_sync(P_FREE, THREADS);  // warpgroup 1 has read P(it-1)
      // P = exp2(s * scale - m) (bf16) into its swizzled tile: row r, keys 8j + 2t (+1)
      // -> chunk j; row sums as trees.
      float sum0[8], sum1[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(fmaf(s[4 * j], p.scale_log2, -msafe[0]));
        const float p1 = exp2f(fmaf(s[4 * j + 1], p.scale_log2, -msafe[0]));
        const float p2 = exp2f(fmaf(s[4 * j + 2], p.scale_log2, -msafe[1]));
        const float p3 = exp2f(fmaf(s[4 * j + 3], p.scale_log2, -msafe[1]));
        sum0[j] = p0 + p1;
        sum1[j] = p2 + p3;
        const int r = rbase + g;  // r % 8 == g, (r + 8) % 8 == g
        *reinterpret_cast<uint32_t*>(gP + r * BLOCK_BYTES + ((j ^ g) << 4) + 4 * t) = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t*>(gP + (r + 8) * BLOCK_BYTES + ((j ^ g) << 4) + 4 * t) = pack_bf16(p2, p3);
      }
#pragma unroll
      for (int w = 4; w > 0; w >>= 1)
#pragma unroll
        for (int j = 0; j < w; ++j) { sum0[j] += sum0[j + w]; sum1[j] += sum1[j + w]; }
      float sum[2] = {sum0[0], sum1[0]};
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        l_run[h] = l_run[h] * alpha[h] + sum[h];
      }
      if (t == 0) { sAlpha[rbase + g] = alpha[0]; sAlpha[rbase + g + 8] = alpha[1]; }
      rescale_rows(alpha, o_at);
      fence_proxy_async();
      named_arrive(P_READY, THREADS);
    } else {
      wgmma_wait<0>();  // this warpgroup's PV(it-1)
      reg_fence(o);
      named_arrive(P_FREE, THREADS);
      named_sync(KV_FREE, THREADS);
      // The next tile streams in while warpgroup 0 works (its slot held tile it-1).
      if (it + 1 < ntiles)
        load_keys(p, table, k_begin + (it + 1) * KEYS, k_end, sKV + ((it + 1) & 1) * KV_BYTES, warp - 4);
      cp_async_commit();
      named_sync(P_READY, THREADS);
      alpha[0] = sAlpha[rbase + g];
      alpha[1] = sAlpha[rbase + g + 8];
      rescale_rows(alpha, o_at);
    }
    // O += P V: 4 k-steps of 16 keys. V is the key tile read MN-major: 64-column blocks
    // 8 KB apart (leading offset), 8-key groups 1 KB apart (stride offset). Not waited
    // for here (see above).
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < KEYS / 16; ++kk) {
      wgmma_m64n256k16_bt(o, sw128_desc(sP + kk * 32, 16, 1024),
                          sw128_desc(sK + wg * 4 * KEYS * BLOCK_BYTES + kk * 16 * BLOCK_BYTES,
                                     KEYS * BLOCK_BYTES, 1024));
    }
    wgmma_commit();
  }
  wgmma_wait<0>();
  reg_fence(o);
  cp_async_wait<0>();

  if (wg == 0 && t == 0) {
    sL[rbase + g] = l_run[0]; sL[rbase + g + 8] = l_run[1];
    sM[rbase + g] = m_run[0]; sM[rbase + g + 8] = m_run[1];
  }
  __syncthreads();

  const int r = rbase + g;
  const float l[2] = {sL[r], sL[r + 8]}, m[2] = {sM[r], sM[r + 8]};
  write_rows(p, b, split, m0 + r, wg * 256, t, l, m, wg == 0 && t == 0, o_at);
#else
  __trap();  // built without sm_90a: the host never launches this (KD_HAS_SM90A)
#endif
}

}  // namespace

int launch_verify_wgmma(const VerifyParams& p, int B, cudaStream_t st) {
  cudaError_t e = cudaFuncSetAttribute(verify_attention_wgmma_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM_BYTES);
  if (e != cudaSuccess) return (int)e;
  dim3 grid(ceil_div(p.R, ROWS), p.num_splits, B);
  verify_attention_wgmma_kernel<<<grid, THREADS, SMEM_BYTES, st>>>(p);
  KD_LAUNCH_CHECK();
  return 0;
}

size_t verify_wgmma_smem_bytes() { return SMEM_BYTES; }

}  // namespace kd
