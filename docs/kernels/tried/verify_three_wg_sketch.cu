// Compile-only sketch (session 28; never run, not built by the library): the register and
// shared-memory plan of a three-warpgroup verify schedule, for the next attempt at the
// compute-bound gap (docs/kernels/verify_attention.md, session 28). Warpgroup 0 holds Q's
// latent block in registers as S's A operand (RS wgmma) and takes S and the softmax, writing
// P into the tile's dead rope box; warpgroups 1 and 2 take PV for one value half each; three
// 72 KB key slots by TMA (FULL, P_READY and EMPTY mbarriers a slot). No masks, splits, merge,
// runs path or correctness: only what ptxas says of it. Compile from the repository root:
//   nvcc -O3 -std=c++17 --use_fast_math -Ikernels/include -gencode arch=compute_90a,code=sm_90a \
//        -Xptxas -v -cubin -o /tmp/sketch.cubin docs/kernels/tried/verify_three_wg_sketch.cu
// What it said (CUDA 13.0): 168 registers at launch (384 threads), no spills with setmaxnreg
// 192 / 160 / 160; 96 bytes of spills at 176 / 168 / 168 and 132 without setmaxnreg; no wgmma
// serialisation. But a launch of 384 threads gives the CTA a pool of 168 registers a thread,
// and setmaxnreg draws only on it: 192 + 160 + 160 cannot be granted (504 at most), and at
// 184 / 160 / 160 the full kernel serialises its wgmmas (session 29: run, 1.31-1.51x slower).
#include <cuda.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include "../../../kernels/src/mma.cuh"
#include "../../../kernels/src/sm90/tma.cuh"
#include "../../../kernels/src/sm90/wgmma.cuh"

namespace kd {
// d (64x64 f32) += A (64x16 in registers) * B (16x64, K-major, SW128).
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N> __device__ __forceinline__ void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

constexpr int KEYS = 64, ROWS = 64, SLOTS = 3, BLOCK = 128;
constexpr int TILE = 9 * KEYS * BLOCK;          // 73,728: 9 column blocks of 64 keys
constexpr int QROPE = ROWS * BLOCK;             // 8,192
constexpr int SMEM = 1024 + SLOTS * TILE + QROPE + 1024;  // + factors and barriers: 231,424 bytes
static_assert(SMEM <= 232448, "fits a Hopper block");

__global__ void __launch_bounds__(384, 1)
three_wg(const __nv_bfloat16* __restrict__ q, __nv_bfloat16* __restrict__ out, float scale_log2, int ntiles,
         const __grid_constant__ CUtensorMap tmap) {
  extern __shared__ unsigned char raw[];
  const uint32_t base = (smem_addr(raw) + 1023) & ~1023u;
  const uint32_t sK = base, sQr = base + SLOTS * TILE;
  float* sAlpha = reinterpret_cast<float*>(raw + (sQr + QROPE - smem_addr(raw)));  // [SLOTS][64]
  const uint32_t bars = sQr + QROPE + SLOTS * ROWS * 4;  // FULL, P_READY, EMPTY per slot
  const int tid = threadIdx.x, wg = tid >> 7, lane = tid & 31, warp = (tid >> 5) & 3;
  const int g = lane >> 2, t = lane & 3;
  if (tid == 0) {
    for (int s = 0; s < SLOTS; ++s) {
      mbar_init(bars + 8 * s, 1);
      mbar_init(bars + 24 + 8 * s, 128);
      mbar_init(bars + 48 + 8 * s, 256);
    }
    mbar_init_fence();
  }
  __syncthreads();
  if (wg == 0) {
    setmaxnreg_inc<192>();
    // Q's latent block as A fragments: 32 k-steps x 4 registers (rows 16w+g, 16w+g+8).
    uint32_t qa[32][4];
    const __nv_bfloat16* qr = q + (size_t)(blockIdx.x * ROWS + warp * 16 + g) * 576;
#pragma unroll
    for (int kk = 0; kk < 32; ++kk) {
      qa[kk][0] = *reinterpret_cast<const uint32_t*>(qr + kk * 16 + 2 * t);
      qa[kk][1] = *reinterpret_cast<const uint32_t*>(qr + 8 * 576 + kk * 16 + 2 * t);
      qa[kk][2] = *reinterpret_cast<const uint32_t*>(qr + kk * 16 + 8 + 2 * t);
      qa[kk][3] = *reinterpret_cast<const uint32_t*>(qr + 8 * 576 + kk * 16 + 8 + 2 * t);
    }
    float m_run[2] = {-INFINITY, -INFINITY}, l_run[2] = {0.f, 0.f};
    for (int it = 0; it < ntiles; ++it) {
      const int s = it % SLOTS;
      const uint32_t tile = sK + s * TILE;
      mbar_wait(bars + 8 * s, (it / SLOTS) & 1);
      float sc[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) sc[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 32; ++kk)
        wgmma_m64n64k16_rs(sc, qa[kk], sw128_desc(tile + (kk >> 2) * KEYS * BLOCK + (kk & 3) * 32, 16, 1024));
#pragma unroll
      for (int kk = 32; kk < 36; ++kk)
        wgmma_m64n64k16(sc, sw128_desc(sQr + (kk & 3) * 32, 16, 1024),
                        sw128_desc(tile + 8 * KEYS * BLOCK + (kk & 3) * 32, 16, 1024), 1);
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(sc);
      float alpha[2], msafe[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 8; ++j) mx = fmaxf(mx, fmaxf(sc[4 * j + 2 * h], sc[4 * j + 2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2)) * scale_log2;
        const float mn = mx > m_run[h] + 8.f ? mx : m_run[h];
        msafe[h] = mn == -INFINITY ? 0.f : mn;
        alpha[h] = exp2f(m_run[h] - msafe[h]);
        m_run[h] = mn;
      }
      // P into the tile's rope box (dead once S has read it).
      unsigned char* box = raw + (tile + 8 * KEYS * BLOCK - smem_addr(raw));
      float sum[2] = {0.f, 0.f};
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float p0 = exp2f(fmaf(sc[4 * j], scale_log2, -msafe[0]));
        const float p1 = exp2f(fmaf(sc[4 * j + 1], scale_log2, -msafe[0]));
        const float p2 = exp2f(fmaf(sc[4 * j + 2], scale_log2, -msafe[1]));
        const float p3 = exp2f(fmaf(sc[4 * j + 3], scale_log2, -msafe[1]));
        sum[0] += p0 + p1; sum[1] += p2 + p3;
        const int r = warp * 16 + g;
        *reinterpret_cast<uint32_t*>(box + r * BLOCK + ((j ^ g) << 4) + 4 * t) = pack_bf16(p0, p1);
        *reinterpret_cast<uint32_t*>(box + (r + 8) * BLOCK + ((j ^ g) << 4) + 4 * t) = pack_bf16(p2, p3);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 1);
        sum[h] += __shfl_xor_sync(0xffffffffu, sum[h], 2);
        l_run[h] = l_run[h] * alpha[h] + sum[h];
      }
      if (t == 0) { sAlpha[s * ROWS + warp * 16 + g] = alpha[0]; sAlpha[s * ROWS + warp * 16 + g + 8] = alpha[1]; }
      fence_proxy_async();
      mbar_arrive(bars + 24 + 8 * s);
    }
    if (t == 0) out[blockIdx.x * ROWS + warp * 16 + g] = __float2bfloat16(l_run[0] + l_run[1]);
  } else {
    setmaxnreg_dec<160>();
    const int half = wg - 1;
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.f;
    const bool producer = wg == 2 && (tid & 127) == 0;
    if (producer)
      for (int i = 0; i < SLOTS && i < ntiles; ++i) {
        mbar_arrive_expect_tx(bars + 8 * i, TILE);
        for (int c = 0; c < 9; ++c) tma_load_2d(sK + i * TILE + c * KEYS * BLOCK, &tmap, c * 64, i * KEYS, bars + 8 * i, l2_evict_first());
      }
    for (int it = 0; it < ntiles; ++it) {
      const int s = it % SLOTS;
      const uint32_t tile = sK + s * TILE;
      mbar_wait(bars + 24 + 8 * s, (it / SLOTS) & 1);
      const float a0 = sAlpha[s * ROWS + warp * 16 + g], a1 = sAlpha[s * ROWS + warp * 16 + g + 8];
      if (__any_sync(0xffffffffu, a0 != 1.f || a1 != 1.f)) {
#pragma unroll
        for (int j = 0; j < 32; ++j) { o[4 * j] *= a0; o[4 * j + 1] *= a0; o[4 * j + 2] *= a1; o[4 * j + 3] *= a1; }
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < 4; ++kk)
        wgmma_m64n256k16_bt(o, sw128_desc(tile + 8 * KEYS * BLOCK + kk * 32, 16, 1024),
                            sw128_desc(tile + half * 4 * KEYS * BLOCK + kk * 16 * BLOCK, KEYS * BLOCK, 1024));
      wgmma_commit();
      wgmma_wait<0>();
      reg_fence(o);
      mbar_arrive(bars + 48 + 8 * s);
      if (producer && it + SLOTS < ntiles) {
        mbar_wait(bars + 48 + 8 * s, (it / SLOTS) & 1);
        mbar_arrive_expect_tx(bars + 8 * s, TILE);
        for (int c = 0; c < 9; ++c)
          tma_load_2d(tile + c * KEYS * BLOCK, &tmap, c * 64, (it + SLOTS) * KEYS, bars + 8 * s, l2_evict_first());
      }
    }
    const int r = blockIdx.x * ROWS + warp * 16 + g;
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      out[(size_t)r * 512 + half * 256 + 8 * j + 2 * t] = __float2bfloat16(o[4 * j]);
      out[(size_t)(r + 8) * 512 + half * 256 + 8 * j + 2 * t] = __float2bfloat16(o[4 * j + 2]);
    }
  }
}
}  // namespace kd
