// Cycles a wgmma step costs on this GPU when nothing else runs: the shapes and operand
// sources the verify kernel's S and PV use, and m64n8k16 / m64n16k16 (a few rows as N), one
// or two warpgroups issuing, one CTA an SM on every SM. A step's tensor work alone is 32
// cycles for m64n64k16 and 128 for m64n256k16 (bf16, 2,048 FMAs a cycle an SM); what a loop
// of them takes above that is what the hardware adds. Operands are zeros: the rate does not
// depend on the values. Last, what a tile's softmax (the verify kernel's arithmetic on 64 x 64
// scores) costs warpgroup 1 alone and while warpgroup 0 keeps the tensor pipe busy (S's steps
// from shared memory or with A from registers, or PV's), whole and without some of its parts.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I kernels/src -I kernels/include -o /tmp/wgmma_rate scripts/wgmma_rate.cu
//   /tmp/wgmma_rate
#include <cstdio>
#include <vector>

#include "mma.cuh"
#include "sm90/wgmma.cuh"

using namespace kd;

constexpr int STEPS = 36;  // S's k-steps over the 576 columns
constexpr int SMEM = 3 * 73728 + 1024;

// m64n64k16 with A from registers (each warp's 16 rows as mma.sync's A fragment).
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, "
      "%10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, "
      "%30, %31}, {%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// m64nNk16 from shared memory for N = 8 and 16: a tile's few live rows taken as the wgmma's N
// (S^T = K Q^T), the form a tail row tile of 8 or 16 rows would use.
__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[4], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, 0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(a), "l"(b));
}
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[8], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, "
      "0, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b));
}

enum Mode { SS64_ONE_WG, SS64_TWO_WG, RS64_ONE_WG, SS256_ONE_WG, SS256_TWO_WG, SS8_ONE_WG, SS8_FOUR_ACC,
            SS16_ONE_WG, SOFTMAX_ALONE, SOFTMAX_UNDER_S, SOFTMAX_UNDER_S_RS, SOFTMAX_UNDER_PV };
// Parts of the softmax kept (SOFTMAX modes): all, without P's shared-memory stores, without
// the stores and the quad shuffles (exp2 and adds only).
enum Parts { ALL, NO_STORES, NO_SHUFFLES };

// A tile's softmax as the verify kernel does it on a thread's 32 scores (two rows): row
// maxima by trees and quad shuffles, exp2 of the scaled scores, row sums, P to shared memory
// as bf16 in the kernel's swizzled layout (every warp on the same 16 rows: the bank pattern
// is what counts).
template <int PARTS>
__device__ __forceinline__ float softmax_tile(float (&s)[32], float scale, uint32_t p_tile, int lane) {
  float mx[2], sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m = thread_row_max(s, h);
    mx[h] = (PARTS == NO_SHUFFLES ? m : quad_max(m)) * scale;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float p0 = exp2f(fmaf(s[4 * j + 2 * h], scale, -mx[h]));
      const float p1 = exp2f(fmaf(s[4 * j + 2 * h + 1], scale, -mx[h]));
      acc[j] = p0 + p1;
      if (PARTS == ALL)
        asm volatile("st.shared.u32 [%0], %1;\n"
                     ::"r"(p_tile + ((lane >> 2) + 8 * h) * 128 + ((j ^ (lane >> 2)) << 4) + 4 * (lane & 3)),
                       "r"(pack_bf16(p0, p1)) : "memory");
    }
#pragma unroll
    for (int w = 4; w > 0; w >>= 1)
#pragma unroll
      for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
    sum[h] = PARTS == NO_SHUFFLES ? acc[0] : quad_sum(acc[0]);
  }
  return sum[0] + sum[1];
}

// The instruction a mode's issuing warpgroup loops over: S's step from shared memory, S's
// step with A from registers, PV's step, or S^T's steps with a few rows as N (m64n8k16 on one
// accumulator or four in turn, m64n16k16).
enum Step { S_SS, S_RS, PV_SS, S8_SS, S8_FOUR, S16_SS };
__host__ __device__ constexpr int step_of(int mode) {
  return mode == SS8_ONE_WG                                                        ? S8_SS
         : mode == SS8_FOUR_ACC                                                     ? S8_FOUR
         : mode == SS16_ONE_WG                                                      ? S16_SS
         : mode == RS64_ONE_WG || mode == SOFTMAX_UNDER_S_RS                         ? S_RS
         : mode == SS256_ONE_WG || mode == SS256_TWO_WG || mode == SOFTMAX_UNDER_PV ? PV_SS
                                                                                     : S_SS;
}

// `loops` loops of STEPS steps of kind STEP, each loop committed and waited for. The small-N
// steps accumulate into the first words of d64.
template <int STEP>
__device__ __forceinline__ void issue_steps(float (&d64)[32], float (&d256)[128], uint32_t a, uint32_t b,
                                            const uint32_t (&frag)[4], int loops) {
  for (int it = 0; it < loops; ++it) {
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < STEPS; ++kk) {
      const uint32_t col = kk >> 2, step = (kk & 3) * 32;
      // S's operands (and S^T's: the same two tiles, A the keys): 16 columns of 64 rows each.
      const uint64_t sa = sw128_desc(a + col * 8192 + step, 16, 1024), sb = sw128_desc(b + col * 8192 + step, 16, 1024);
      if constexpr (STEP == PV_SS) {
        wgmma_m64n256k16_bt(d256, sa, sw128_desc(b + (kk & 3) * 16 * 128, 64 * 128, 1024));
      } else if constexpr (STEP == S8_SS || STEP == S8_FOUR) {  // four in turn: no step waits on the last
        wgmma_m64n8k16(*reinterpret_cast<float(*)[4]>(d64 + (STEP == S8_FOUR ? 4 * (kk & 3) : 0)), sa, sb);
      } else if constexpr (STEP == S16_SS) {
        wgmma_m64n16k16(*reinterpret_cast<float(*)[8]>(d64), sa, sb);
      } else if constexpr (STEP == S_RS) {
        wgmma_m64n64k16_rs(d64, frag, sb);
      } else {
        wgmma_m64n64k16(d64, sa, sb, 1);
      }
    }
    wgmma_commit();
    wgmma_wait<0>();
  }
}

// Step modes: each issuing warpgroup times its own loops. Softmax modes: warpgroup 1 times
// `iters` softmaxes while warpgroup 0 (unless alone) issues steps for longer.
template <int MODE, int PARTS = ALL>
__global__ void __launch_bounds__(256, 1) rate(long long* cycles, float* sink, int iters) {
  extern __shared__ unsigned char raw[];
  for (int i = threadIdx.x; i < SMEM / 4; i += blockDim.x) reinterpret_cast<float*>(raw)[i] = 0.f;
  fence_proxy_async();
  __syncthreads();
  const uint32_t base = (smem_addr(raw) + 1023) & ~1023u;
  const int wg = threadIdx.x / 128;
  constexpr bool SOFTMAX = MODE >= SOFTMAX_ALONE;
  const bool issues = SOFTMAX ? (wg == 0 && MODE != SOFTMAX_ALONE)
                              : (wg == 0 || MODE == SS64_TWO_WG || MODE == SS256_TWO_WG);
  const bool timed = SOFTMAX ? wg == 1 : issues;
  const uint32_t a = base + wg * 73728, b = base + 2 * 73728;  // A per warpgroup, B shared
  float d64[32] = {}, d256[128] = {};
  const uint32_t frag[4] = {0u, 0u, 0u, 0u};
  float acc = 0.f;
  const long long t0 = clock64();
  if (SOFTMAX && wg == 1) {
    float sc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) sc[i] = (float)(threadIdx.x % 7 + i);
    for (int it = 0; it < iters; ++it) {
#pragma unroll
      for (int i = 0; i < 32; ++i) sc[i] = fmaf(sc[i], 0.999f, acc * 1e-9f);
      acc += softmax_tile<PARTS>(sc, 0.1887f, a, threadIdx.x & 31);  // its own A tile: not S's operands
    }
  } else if (issues) {
    issue_steps<step_of(MODE)>(d64, d256, a, b, frag, SOFTMAX ? 10 * iters : iters);  // outlasts the softmaxes
  }
  const long long t1 = clock64();
  float s = acc == -1.f ? 1.f : 0.f;
  for (int i = 0; i < 32; ++i) s += d64[i];
  for (int i = 0; i < 128; ++i) s += d256[i];
  if (s != 0.f) sink[threadIdx.x] = s;  // zeros in, zeros out (acc is never -1): keeps the loops
  if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + wg] = timed ? t1 - t0 : 0;
}

template <int MODE, int PARTS = ALL>
void run(const char* name, int sms, int iters) {
  long long* dc;
  float* ds;
  cudaMalloc(&dc, sms * 2 * sizeof(long long));
  cudaMalloc(&ds, 256 * sizeof(float));
  cudaFuncSetAttribute(rate<MODE, PARTS>, cudaFuncAttributeMaxDynamicSharedMemorySize, SMEM);
  rate<MODE, PARTS><<<sms, 256, SMEM>>>(dc, ds, 10);  // warm-up
  rate<MODE, PARTS><<<sms, 256, SMEM>>>(dc, ds, iters);
  std::vector<long long> c(sms * 2);
  cudaMemcpy(c.data(), dc, c.size() * sizeof(long long), cudaMemcpyDeviceToHost);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) { printf("%s: %s\n", name, cudaGetErrorString(e)); return; }
  double sum = 0;
  int n = 0;
  for (long long x : c) if (x > 0) { sum += (double)x; ++n; }
  if (MODE >= SOFTMAX_ALONE)
    printf("%-34s %7.1f cycles a tile (warpgroup 1, mean over %d)\n", name, sum / n / iters, n);
  else
    printf("%-34s %7.1f cycles a step (a warpgroup's own steps, mean over %d)\n", name,
           sum / n / ((double)iters * STEPS), n);
  cudaFree(dc);
  cudaFree(ds);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int iters = 2000;
  run<SS64_ONE_WG>("m64n64k16 SS, one warpgroup", sms, iters);
  run<SS64_TWO_WG>("m64n64k16 SS, two warpgroups", sms, iters);
  run<RS64_ONE_WG>("m64n64k16 RS, one warpgroup", sms, iters);
  run<SS256_ONE_WG>("m64n256k16 SS (B MN-major), one", sms, iters / 4);
  run<SS256_TWO_WG>("m64n256k16 SS (B MN-major), two", sms, iters / 4);
  run<SS8_ONE_WG>("m64n8k16 SS, one warpgroup", sms, iters);
  run<SS8_FOUR_ACC>("m64n8k16 SS, four accumulators", sms, iters);
  run<SS16_ONE_WG>("m64n16k16 SS, one warpgroup", sms, iters);
  run<SOFTMAX_ALONE>("softmax of a tile, alone", sms, iters);
  run<SOFTMAX_UNDER_S>("softmax of a tile, under S", sms, iters);
  run<SOFTMAX_UNDER_S_RS>("softmax of a tile, under S (RS)", sms, iters);
  run<SOFTMAX_UNDER_PV>("softmax of a tile, under PV", sms, iters);
  run<SOFTMAX_ALONE, NO_STORES>("  without P's stores, alone", sms, iters);
  run<SOFTMAX_UNDER_S, NO_STORES>("  without P's stores, under S", sms, iters);
  run<SOFTMAX_ALONE, NO_SHUFFLES>("  exp2 and adds only, alone", sms, iters);
  run<SOFTMAX_UNDER_S, NO_SHUFFLES>("  exp2 and adds only, under S", sms, iters);
  return 0;
}
