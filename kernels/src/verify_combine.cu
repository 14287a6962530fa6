// Merge the key splits of each query row by their LSEs (spec verify_attention.md):
// out = sum_s exp(lse_s - lse) * o_s, lse = log sum_s exp(lse_s).
//
// Partials are bf16 (write_rows says why); weights and sums are float32. Two layouts:
// - fewer than 32 splits: a warp takes half a row (8 columns a lane, one 16-byte load a
//   split) and reduces the row's LSEs with shuffles alone (a split a lane): no shared
//   memory, no block barrier, 8 warps a CTA.
// - 32 splits or more: a CTA of 8 warps takes a quarter of a row and its warps split the
//   splits (warp w sums splits w, w + 8, ...), so each lane has 4-16 independent loads in
//   flight; the warps' sums then meet in shared memory. Below 32 splits this layout loses:
//   four times the CTAs, each redoing the LSE reductions for one load a lane.
// The layouts it replaced and their times: docs/kernels/verify_attention.md (v2c, v7).
#include "mma.cuh"
#include "verify_common.cuh"

// 0 builds the combine as a plain launch (for same-run A/Bs against programmatic launch).
#ifndef KD_PDL
#define KD_PDL 1
#endif

namespace kd {
namespace {

constexpr int WARPS = 8;
constexpr int ROW_SPLITS = 32;  // below this a warp takes half a row
static_assert(4 * 32 >= MAX_SPLITS, "a quarter-row CTA reads one split LSE a thread");

// bf16 -> float32 is the bf16 bits in the high half of a word.
__device__ __forceinline__ float lo_f(uint32_t u) { return __uint_as_float(u << 16); }
__device__ __forceinline__ float hi_f(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
__device__ __forceinline__ void fma4(float4& a, float w, uint2 u) {
  a.x += w * lo_f(u.x); a.y += w * hi_f(u.x); a.z += w * lo_f(u.y); a.w += w * hi_f(u.y);
}

// --- fewer than 32 splits: a warp per half row.
// Splits whose loads are issued before the weights are known (their latency overlaps the
// LSE reductions); 8 x 16 bytes a lane.
constexpr int ROW_PRE = 8;

// SPARSE (plans whose requests take their own counts, split_base != 0): a short request's
// later splits hold no keys, so the LSEs are read first and only live splits' rows loaded;
// a request whose split 0 held every key wrote its own rows (its empty splits' LSEs +inf).
// Rows row0 .. R-1 of each request (`rows` of them; row0 > 0: the last row tile of a
// TAIL_SPLITS plan, whose main row tiles wrote their own).
template <bool SPARSE>
__global__ void __launch_bounds__(32 * WARPS)
combine_half_rows(const __nv_bfloat16* __restrict__ part_out, const float* __restrict__ part_lse, int R,
                  int row0, int rows, int num_splits, int halves, __nv_bfloat16* __restrict__ out,
                  float* __restrict__ lse) {
  const int lane = threadIdx.x & 31;
  const int w = blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (w >= halves) return;  // whole warps only: the shuffles below need all 32 lanes
  const int i = w >> 1, half = w & 1;  // i = b * rows + row - row0
  const int b = i / rows, row = row0 + i - b * rows;
  const size_t br = (size_t)b * R + row;  // the row in out and lse
  const size_t base = (size_t)b * num_splits * R + row;  // + s * R
  const int c = half * (V_DIM / 2) + lane * 8;
  const auto src = [&](int s) {
    return reinterpret_cast<const uint4*>(part_out + (base + (size_t)s * R) * V_DIM + c);
  };
  pdl_wait();  // the attention kernel's partials
  float my_lse = -INFINITY;
  uint32_t live = ~0u;  // splits whose rows are loaded
  if constexpr (SPARSE) {
    my_lse = lane < num_splits ? part_lse[base + (size_t)lane * R] : -INFINITY;
    if (__any_sync(0xffffffffu, my_lse == INFINITY)) return;
    live = __ballot_sync(0xffffffffu, my_lse != -INFINITY);
  }
  uint4 pre[ROW_PRE];
#pragma unroll
  for (int i = 0; i < ROW_PRE; ++i)
    pre[i] = i < num_splits && (live >> i & 1u) ? __ldg(src(i)) : make_uint4(0u, 0u, 0u, 0u);
  if constexpr (!SPARSE) my_lse = lane < num_splits ? part_lse[base + (size_t)lane * R] : -INFINITY;
  const float m = warp_max(my_lse);
  const float wt = my_lse == -INFINITY ? 0.f : exp2f((my_lse - m) * LOG2E);
  const float tot = warp_sum(wt);
  const float inv = tot > 0.f ? 1.f / tot : 0.f;

  // An empty split (weight 0) is skipped by a select, not multiplied in (its rows hold
  // whatever the kernel wrote for no keys).
  float4 a0 = make_float4(0.f, 0.f, 0.f, 0.f), a1 = a0;
#pragma unroll
  for (int i = 0; i < ROW_PRE; ++i) {
    const float ws = __shfl_sync(0xffffffffu, wt, i);
    if (i < num_splits && ws != 0.f) {
      fma4(a0, ws, make_uint2(pre[i].x, pre[i].y));
      fma4(a1, ws, make_uint2(pre[i].z, pre[i].w));
    }
  }
#pragma unroll 4
  for (int s = ROW_PRE; s < num_splits; ++s) {
    if (SPARSE && !(live >> s & 1u)) continue;
    const uint4 v = __ldg(src(s));
    const float ws = __shfl_sync(0xffffffffu, wt, s);
    if (ws != 0.f) { fma4(a0, ws, make_uint2(v.x, v.y)); fma4(a1, ws, make_uint2(v.z, v.w)); }
  }
  const uint4 o = make_uint4(pack_bf16(a0.x * inv, a0.y * inv), pack_bf16(a0.z * inv, a0.w * inv),
                             pack_bf16(a1.x * inv, a1.y * inv), pack_bf16(a1.z * inv, a1.w * inv));
  *reinterpret_cast<uint4*>(out + br * V_DIM + c) = o;
  if (half == 0 && lane == 0) lse[br] = tot > 0.f ? m + logf(tot) : -INFINITY;
}

// --- 32 splits or more: a CTA per quarter row, its warps splitting the splits.
constexpr int QUARTER = V_DIM / 4;  // value columns of a CTA: 32 lanes x 4
// Splits a lane loads before the weights are known: more loads in flight, but 8 costs
// occupancy at 33 splits (A/B in docs/kernels/verify_attention.md).
constexpr int PRE = 4;
// Its shared memory, one struct so the held launch can count the static bytes.
struct QuarterShared {
  float4 acc[WARPS][32];  // the warps' sums, added by warp 0
  float w[MAX_SPLITS];    // the splits' weights
  float red[WARPS];       // a value a warp in the block reductions
};

__global__ void __launch_bounds__(32 * WARPS)
combine_quarter_rows(const __nv_bfloat16* __restrict__ part_out, const float* __restrict__ part_lse, int R,
                     int num_splits, __nv_bfloat16* __restrict__ out, float* __restrict__ lse) {
  __shared__ QuarterShared sh;
  const int quarter = blockIdx.x, row = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const size_t base = (size_t)b * num_splits * R + row;  // + s * R
  const int c = quarter * QUARTER + lane * 4;
  const auto src = [&](int s) {
    return reinterpret_cast<const uint2*>(part_out + (base + (size_t)s * R) * V_DIM + c);
  };
  // This warp's first PRE splits, loaded raw before the weights are known, so their
  // latency overlaps the LSE reductions (widened only where used).
  pdl_wait();  // the attention kernel's partials
  uint2 pre[PRE];
#pragma unroll
  for (int i = 0; i < PRE; ++i) {
    const int s = warp + i * WARPS;
    pre[i] = s < num_splits ? __ldg(src(s)) : make_uint2(0u, 0u);
  }
  // Block max of the split LSEs, then the sum of their exponentials. A CTA has at least
  // MAX_SPLITS threads, so each thread reads at most one LSE, once.
  const float my_lse = tid < num_splits ? part_lse[base + (size_t)tid * R] : -INFINITY;
  float m = warp_max(my_lse);
  if (lane == 0) sh.red[warp] = m;
  __syncthreads();
  m = sh.red[0];
  for (int w = 1; w < WARPS; ++w) m = fmaxf(m, sh.red[w]);
  __syncthreads();
  float tot = my_lse == -INFINITY ? 0.f : exp2f((my_lse - m) * LOG2E);
  if (tid < num_splits) sh.w[tid] = tot;
  tot = warp_sum(tot);
  if (lane == 0) sh.red[warp] = tot;
  __syncthreads();
  tot = 0.f;
  for (int w = 0; w < WARPS; ++w) tot += sh.red[w];
  const float inv = tot > 0.f ? 1.f / tot : 0.f;

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < PRE; ++i) {
    const int s = warp + i * WARPS;
    const float w = s < num_splits ? sh.w[s] : 0.f;
    if (w != 0.f) fma4(acc, w, pre[i]);
  }
#pragma unroll 8
  for (int s = warp + PRE * WARPS; s < num_splits; s += WARPS) {
    const uint2 v = __ldg(src(s));
    const float w = sh.w[s];
    if (w != 0.f) fma4(acc, w, v);
  }
  sh.acc[warp][lane] = acc;
  __syncthreads();
  if (warp == 0) {
    for (int g = 1; g < WARPS; ++g) {
      const float4 x = sh.acc[g][lane];
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    __nv_bfloat16* dst = out + ((size_t)b * R + row) * V_DIM + c;
    *reinterpret_cast<uint2*>(dst) = make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
    if (quarter == 0 && lane == 0) lse[(size_t)b * R + row] = tot > 0.f ? m + logf(tot) : -INFINITY;
  }
}

// `how` (CombineLaunch): a dependent is launched as a programmatic dependent of the
// attention kernel (its CTAs may be scheduled as that kernel drains, and wait in
// pdl_wait()). HELD asks for enough shared memory (unused) that at most ceil(CTAs / SMs)
// CTAs fit an SM: CTAs scheduled early land on the SMs the attention kernel leaves free, and
// more there would pile the combine's reads onto those few SMs.
template <auto Kernel, class... Args>
int launch(dim3 grid, int static_smem, cudaStream_t st, int how, const DeviceFacts& d, Args... args) {
  size_t smem = 0;
  if (KD_PDL && how == COMBINE_PROGRAMMATIC_HELD) {
    const long long ctas = (long long)grid.x * grid.y * grid.z;
    const int held = (int)((ctas + d.sms - 1) / d.sms);
    // A CTA's footprint just over 1 / (held + 1) of the SM's shared memory: held fit, one
    // more does not. The carveout at its maximum, so the SM offers all of smem_sm. The
    // attribute is the bound for every held count (held 1's footprint), one value for all
    // launches, so that concurrent launches of other counts cannot lower it under this one.
    const int footprint = d.smem_sm / (held + 1) + 1;
    smem = (size_t)max(0, footprint - static_smem - d.smem_reserved);
    const cudaError_t e = configure_once<Kernel>(d.smem_sm / 2 + 1, (int)cudaSharedmemCarveoutMaxShared);
    if (e != cudaSuccess) return (int)e;
  }
  return (int)launch_kernel(Kernel, grid, dim3(32 * WARPS), smem, st, KD_PDL && how != COMBINE_PLAIN, args...);
}

// The half-row combine of a plan over rows row0 .. R-1, SPARSE for per-request plans.
template <bool SPARSE>
int launch_half_rows(const VerifyParams& p, int B, int row0, dim3 grid, cudaStream_t st, int how,
                     const DeviceFacts& d) {
  return launch<combine_half_rows<SPARSE>>(grid, 0, st, how, d, p.part_out, p.part_lse, p.R, row0, p.R - row0,
                                           p.num_splits, 2 * B * (p.R - row0), p.out, p.lse);
}

// The combine's grid: below ROW_SPLITS splits a warp per half row (WARPS a CTA), else a
// CTA per quarter row.
dim3 combine_grid(int B, int R, int num_splits) {
  return num_splits < ROW_SPLITS ? dim3(ceil_div(2 * B * R, WARPS)) : dim3(4, R, B);
}

}  // namespace

long long combine_ctas(int B, int R, int num_splits) {
  const dim3 g = combine_grid(B, R, num_splits);
  return (long long)g.x * g.y * g.z;
}

int launch_verify_combine(const VerifyParams& p, int B, int row0, cudaStream_t st, int how, const DeviceFacts& d) {
  const dim3 grid = combine_grid(B, p.R - row0, p.num_splits);
  const int rc = p.num_splits < ROW_SPLITS
      ? (p.split_base != 0 ? launch_half_rows<true>(p, B, row0, grid, st, how, d)
                           : launch_half_rows<false>(p, B, row0, grid, st, how, d))
      : launch<combine_quarter_rows>(grid, (int)sizeof(QuarterShared), st, how, d, p.part_out, p.part_lse, p.R,
                                     p.num_splits, p.out, p.lse);
  if (rc) return rc;
  KD_LAUNCH_CHECK();
  return 0;
}

}  // namespace kd
