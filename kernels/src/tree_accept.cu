// Greedy tree accept (spec ddtree.md section 5), walking the left-child / right-sibling
// lists from the root as SGLang's verify_tree_greedy does.
//
// The walk is a chain of dependent loads, so its cost is their latency: a group of
// threads per request first copies the request's rows to shared memory with coalesced
// loads (one round trip to L2 instead of one per visited slot), then its first thread
// walks there. Small trees take a warp per request (4 a CTA); from D > 64 a request gets
// the whole 128-thread CTA, so its copy is one round trip too (a warp needed D/32 of
// them, partly serialised). Requests too wide for shared memory walk global memory.
#include "common.cuh"

namespace kd {
namespace {

constexpr int ACCEPT_THREADS = 128;
constexpr int ACCEPT_WARPS = ACCEPT_THREADS / 32;    // requests per CTA, at most
constexpr size_t ACCEPT_SMEM_MAX = 96 * 1024;        // fits sm_90 and sm_120 opt-in limits

// One slot as the walk reads it: a visit is one 16-byte shared-memory load.
struct alignas(16) Slot {
  int64_t candidate;
  int32_t next_token;     // -1 (or out of range in the input): no child
  int32_t next_sibling;
};
// Per request: the slots, then the targets (read once per accepted slot).
__host__ __device__ inline size_t accept_row_bytes(int D) {
  return ((size_t)D * (sizeof(Slot) + 8) + 15) / 16 * 16;
}

// The walk: from the root's first child, descend on a match, else go to the next sibling.
// slot(i) gives slot i (links out of range as -1), target(i) its target. Each step visits
// a new slot; the cap keeps a cyclic (corrupt) list from hanging. Returns the accepted
// count; idx gets their global slot ids, *want the bonus token.
template <class SlotAt, class TargetAt>
__device__ __forceinline__ int walk(SlotAt slot, TargetAt target, int D, int max_depth, size_t row,
                                    int32_t* idx, int64_t* want) {
  int k = 0;
  *want = target(0);
  int child = slot(0).next_token;
  for (int steps = 0; child >= 0 && k < max_depth && steps < D; ++steps) {
    const Slot v = slot(child);
    if (v.candidate == *want) {
      idx[++k] = (int32_t)(row + child);
      *want = target(child);
      child = v.next_token;
    } else {
      child = v.next_sibling;
    }
  }
  return k;
}

__device__ __forceinline__ int32_t link_or_none(int64_t x, int D) {
  return (int32_t)(x >= 0 && x < D ? x : -1);  // out of range ends the walk
}

// GROUP threads per request: 32 (a warp; ACCEPT_WARPS requests a CTA) or ACCEPT_THREADS.
template <bool STAGED, int GROUP>
__global__ void __launch_bounds__(ACCEPT_THREADS)
tree_accept_kernel(const int64_t* __restrict__ candidates, const int64_t* __restrict__ next_token,
                   const int64_t* __restrict__ next_sibling, const int64_t* __restrict__ target,
                   int B, int D, int max_depth, int32_t* __restrict__ accept_index,
                   int32_t* __restrict__ accept_len, int64_t* __restrict__ bonus) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const int b = blockIdx.x * (ACCEPT_THREADS / GROUP) + group;
  if (b >= B) return;  // the whole group leaves together (a CTA group: all of b's CTA)
  const size_t row = (size_t)b * D;
  const int64_t* cand = candidates + row;
  const int64_t* tgt = target + row;
  int32_t* idx = accept_index + (size_t)b * (max_depth + 1);
  int k = 0;
  int64_t want = 0;
  __shared__ int s_k[ACCEPT_WARPS];
  if (STAGED) {
    Slot* s_slot = reinterpret_cast<Slot*>(smem + group * accept_row_bytes(D));
    int64_t* s_tgt = reinterpret_cast<int64_t*>(s_slot + D);
#pragma unroll 4
    for (int i = lane; i < D; i += GROUP) {
      const int64_t nt = next_token[row + i], ns = next_sibling[row + i];
      Slot v;
      v.candidate = cand[i];
      v.next_token = link_or_none(nt, D);
      v.next_sibling = link_or_none(ns, D);
      s_slot[i] = v;
      s_tgt[i] = tgt[i];
    }
    if (GROUP == 32) __syncwarp(); else __syncthreads();
    if (lane == 0) {
      idx[0] = (int32_t)row;
      k = walk([&](int i) { return s_slot[i]; }, [&](int i) { return s_tgt[i]; }, D, max_depth, row,
               idx, &want);
    }
  } else if (lane == 0) {  // rows too wide to stage: the same walk over global memory
    idx[0] = (int32_t)row;
    k = walk([&](int i) {
               Slot v;
               v.candidate = cand[i];
               v.next_token = link_or_none(next_token[row + i], D);
               v.next_sibling = link_or_none(next_sibling[row + i], D);
               return v;
             },
             [&](int i) { return tgt[i]; }, D, max_depth, row, idx, &want);
  }
  // The group learns k from its first thread, then pads the index row in parallel.
  if (lane == 0) s_k[group] = k;
  if (GROUP == 32) __syncwarp(); else __syncthreads();
  k = s_k[group];
  for (int j = k + 1 + lane; j <= max_depth; j += GROUP) idx[j] = -1;
  if (lane == 0) {
    accept_len[b] = k;
    bonus[b] = want;
  }
}

}  // namespace
}  // namespace kd

extern "C" int kd_tree_accept(const int64_t* candidates, const int64_t* next_token,
                              const int64_t* next_sibling, const int64_t* target, int B, int D,
                              int max_depth, int32_t* accept_index, int32_t* accept_len,
                              int64_t* bonus, void* stream) {
  if (B < 0 || D < 1 || max_depth < 0) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
  const size_t row_bytes = kd::accept_row_bytes(D);
  if (row_bytes > kd::ACCEPT_SMEM_MAX) {  // rows too wide to stage (D > ~4000)
    kd::tree_accept_kernel<false, 32><<<kd::ceil_div(B, kd::ACCEPT_WARPS), kd::ACCEPT_THREADS, 0, st>>>(
        candidates, next_token, next_sibling, target, B, D, max_depth, accept_index, accept_len, bonus);
  } else if (D > 64 || kd::ACCEPT_WARPS * row_bytes > kd::ACCEPT_SMEM_MAX) {  // a CTA a request
    const cudaError_t e = cudaFuncSetAttribute(kd::tree_accept_kernel<true, kd::ACCEPT_THREADS>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, (int)row_bytes);
    if (e != cudaSuccess) return (int)e;
    kd::tree_accept_kernel<true, kd::ACCEPT_THREADS><<<B, kd::ACCEPT_THREADS, row_bytes, st>>>(
        candidates, next_token, next_sibling, target, B, D, max_depth, accept_index, accept_len, bonus);
  } else {  // a warp a request
    const size_t smem = kd::ACCEPT_WARPS * row_bytes;
    kd::tree_accept_kernel<true, 32><<<kd::ceil_div(B, kd::ACCEPT_WARPS), kd::ACCEPT_THREADS, smem, st>>>(
        candidates, next_token, next_sibling, target, B, D, max_depth, accept_index, accept_len, bonus);
  }
  KD_LAUNCH_CHECK();
  return 0;
}
