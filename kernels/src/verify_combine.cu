// Merge the key splits of each query row by their LSEs (spec verify_attention.md):
// out = sum_s exp(lse_s - lse) * o_s, lse = log sum_s exp(lse_s).
//
// Work split: each lane takes 4 value columns (a float4). With fewer than 32 splits a
// CTA of 4 warps takes a whole row (a column quarter a warp, all splits); with 32 or more
// a CTA of 8 warps takes a quarter of a row and its warps split the splits (warp w sums
// splits w, w + 8, ...), so each lane has 4-16 independent loads in flight; the warps'
// sums then meet in shared memory. (From 8 splits on, the quarter layout cost 10-50% at
// batch 1 with 8-16 row tiles, H200 reference run at 30039d9: four times the CTAs, each
// redoing the LSE reductions for one load a lane.)
// v2 had one 128-thread CTA a row walk all the splits: 13.7 us at batch 1 for H 8, D 1,
// P 8k with 128 splits on an H200 (the attention kernel itself took 10 us).
#include "mma.cuh"
#include "verify_common.cuh"

namespace kd {
namespace {

constexpr int COMBINE_WARPS = 8;  // at most
static_assert(4 * 32 >= MAX_SPLITS, "a combine CTA (4 or 8 warps) reads one split LSE a thread");
constexpr int QUARTER = V_DIM / 4;  // value columns of a warp: 32 lanes x float4
// Splits a lane loads before the weights are known (H200, same-run A/B: 4 gained up to 5%
// at batch 1, 8 lost as much at 33 splits, where the extra registers cost occupancy).
constexpr int PRE = 4;

// quarters: column quarters a CTA covers (1: 8 warps, 8 split groups; 4: 4 warps, 1 group).
__global__ void __launch_bounds__(32 * COMBINE_WARPS)
verify_combine_kernel(const float* __restrict__ part_out, const float* __restrict__ part_lse, int R,
                      int num_splits, int quarters, __nv_bfloat16* __restrict__ out,
                      float* __restrict__ lse) {
  __shared__ float s_w[MAX_SPLITS];
  __shared__ float s_red[COMBINE_WARPS];
  __shared__ float4 s_acc[COMBINE_WARPS][32];
  const int row = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  const int quarter = blockIdx.x * quarters + warp % quarters, group = warp / quarters;
  const int groups = nw / quarters;
  const size_t base = (size_t)b * num_splits * R + row;  // + s * R

  // This warp's first PRE splits for the lane's 4 columns are loaded before the weights
  // are known, so their latency overlaps the LSE reductions (one round trip, not two).
  const int c = quarter * QUARTER + lane * 4;
  float4 pre[PRE];
#pragma unroll
  for (int i = 0; i < PRE; ++i) {
    const int s = group + i * groups;
    const float4* src = reinterpret_cast<const float4*>(part_out + (base + (size_t)s * R) * V_DIM + c);
    pre[i] = s < num_splits ? __ldg(src) : make_float4(0.f, 0.f, 0.f, 0.f);
  }
  // Block max of the split LSEs, then the sum of their exponentials (each CTA of a row
  // does this itself). A CTA has at least MAX_SPLITS threads, so each thread reads at
  // most one LSE, once, and keeps it in a register for both passes.
  const float my_lse = tid < num_splits ? part_lse[base + (size_t)tid * R] : -INFINITY;
  float m = my_lse;
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (lane == 0) s_red[warp] = m;
  __syncthreads();
  m = s_red[0];
  for (int w = 1; w < nw; ++w) m = fmaxf(m, s_red[w]);
  __syncthreads();
  float tot = my_lse == -INFINITY ? 0.f : exp2f((my_lse - m) * LOG2E);
  if (tid < num_splits) s_w[tid] = tot;
  for (int o = 16; o > 0; o >>= 1) tot += __shfl_xor_sync(0xffffffffu, tot, o);
  if (lane == 0) s_red[warp] = tot;
  __syncthreads();
  tot = 0.f;
  for (int w = 0; w < nw; ++w) tot += s_red[w];
  const float inv = tot > 0.f ? 1.f / tot : 0.f;

  // The preloaded splits, then the rest of this warp's. Loads are unconditional (every
  // split's rows are allocated) so they can all be in flight; an empty split (weight 0) is
  // skipped by a select, not multiplied in.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int i = 0; i < PRE; ++i) {
    const int s = group + i * groups;
    const float w = s < num_splits ? s_w[s] : 0.f;
    const float4 v = pre[i];
    if (w != 0.f) { acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w; }
  }
  const int first = group + PRE * groups;
#pragma unroll 8
  for (int s = first; s < num_splits; s += groups) {
    const float4 v = __ldg(reinterpret_cast<const float4*>(part_out + (base + (size_t)s * R) * V_DIM + c));
    const float w = s_w[s];
    if (w != 0.f) { acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w; }
  }
  s_acc[warp][lane] = acc;
  __syncthreads();
  if (group == 0) {
    for (int g = 1; g < groups; ++g) {
      const float4 x = s_acc[warp + g * quarters][lane];
      acc.x += x.x; acc.y += x.y; acc.z += x.z; acc.w += x.w;
    }
    __nv_bfloat16* dst = out + ((size_t)b * R + row) * V_DIM + c;
    *reinterpret_cast<uint32_t*>(dst) = pack_bf16(acc.x * inv, acc.y * inv);
    *reinterpret_cast<uint32_t*>(dst + 2) = pack_bf16(acc.z * inv, acc.w * inv);
    if (quarter == 0 && lane == 0) lse[(size_t)b * R + row] = tot > 0.f ? m + logf(tot) : -INFINITY;
  }
}

constexpr int QUARTER_SPLITS = 32;  // from here on a CTA takes a quarter row

}  // namespace

int launch_verify_combine(const VerifyParams& p, int B, cudaStream_t st) {
  const bool many = p.num_splits >= QUARTER_SPLITS;
  const int quarters = many ? 1 : 4;
  verify_combine_kernel<<<dim3(4 / quarters, p.R, B), 32 * (many ? COMBINE_WARPS : 4), 0, st>>>(
      p.part_out, p.part_lse, p.R, p.num_splits, quarters, p.out, p.lse);
  KD_LAUNCH_CHECK();
  return 0;
}

}  // namespace kd
