// Greedy tree accept (spec ddtree.md section 5) from parent indices, for callers that have
// them: this project's build writes parents and node counts beside the lists.
//
// The list walk (tree_accept.cu) tests one sibling per dependent load, so a batch takes
// ~70-100 cycles for every slot its longest walk passes over. Given parents, every slot
// tests itself at once: slot i matches when its token equals its parent's target, and each
// parent keeps its smallest matching child (an atomicMin in shared memory). That is the
// child the list walk takes: a node's children are listed in ascending slot order. The
// accepted path is then one dependent shared-memory load a level, at most max_depth.
//
// Nodes are slots 1..n (n = node_counts[b], clamped to [0, D - 1]) whose parent lies in
// [0, i); any other slot is not in the tree (padding slots, whose parent is 0, are excluded
// by n). Every step goes to a larger slot, so no row, however corrupt, makes the walk loop.
#include "common.cuh"

namespace kd {
namespace {

constexpr int AP_THREADS = 256;     // a CTA; small trees share it, a warp a request
constexpr int AP_MAX_SLOTS = 4096;  // 12 bytes a slot of shared memory: 48 KB

// Shared memory per request: targets (i64) then each slot's smallest matching child (i32).
__host__ __device__ inline size_t ap_row_bytes(int D) { return ((size_t)D * 12 + 15) & ~(size_t)15; }

// GROUP threads per request (32, or the whole CTA); each holds SLOTS slots in registers.
template <int GROUP, int SLOTS>
__global__ void __launch_bounds__(AP_THREADS)
accept_parents_kernel(const int64_t* __restrict__ candidates, const int32_t* __restrict__ parents,
                      const int32_t* __restrict__ node_counts, const int64_t* __restrict__ target,
                      int B, int D, int max_depth, int32_t* __restrict__ accept_index,
                      int32_t* __restrict__ accept_len, int64_t* __restrict__ bonus) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int group = threadIdx.x / GROUP, lane = threadIdx.x % GROUP;
  const int b = blockIdx.x * (blockDim.x / GROUP) + group;
  if (b >= B) return;  // the whole group leaves together
  const size_t row = (size_t)b * D;
  int64_t* s_tgt = reinterpret_cast<int64_t*>(smem + group * ap_row_bytes(D));
  int32_t* s_first = reinterpret_cast<int32_t*>(s_tgt + D);  // D: no matching child
  auto group_sync = [] { if (GROUP == 32) __syncwarp(); else __syncthreads(); };

  // One round trip: every load is issued before any store.
  const int n = min(max(node_counts[b], 0), D - 1);
  int64_t cand[SLOTS], tgt[SLOTS];
  int32_t par[SLOTS];
#pragma unroll
  for (int u = 0; u < SLOTS; ++u) {
    const int i = u * GROUP + lane;
    cand[u] = 0; tgt[u] = 0; par[u] = -1;
    if (i < D) cand[u] = candidates[row + i], tgt[u] = target[row + i], par[u] = parents[row + i];
  }
#pragma unroll
  for (int u = 0; u < SLOTS; ++u) {
    const int i = u * GROUP + lane;
    if (i < D) { s_tgt[i] = tgt[u]; s_first[i] = D; }
  }
  group_sync();
#pragma unroll
  for (int u = 0; u < SLOTS; ++u) {
    const int i = u * GROUP + lane, p = par[u];
    if (i >= 1 && i <= n && p >= 0 && p < i && cand[u] == s_tgt[p]) atomicMin(&s_first[p], i);
  }
  group_sync();
  if (lane == 0) {
    int32_t* idx = accept_index + (size_t)b * (max_depth + 1);
    idx[0] = (int32_t)row;
    int cur = 0, k = 0;
    for (int next = s_first[0]; k < max_depth && next < D; next = s_first[cur]) {
      idx[++k] = (int32_t)(row + next);
      cur = next;
    }
    for (int j = k + 1; j <= max_depth; ++j) idx[j] = -1;
    accept_len[b] = k;
    bonus[b] = s_tgt[cur];
  }
}

template <int GROUP, int SLOTS>
int launch(const int64_t* candidates, const int32_t* parents, const int32_t* node_counts,
           const int64_t* target, int B, int D, int max_depth, int32_t* accept_index,
           int32_t* accept_len, int64_t* bonus, cudaStream_t st) {
  // Small trees: 4 requests a 128-thread CTA; larger ones a 256-thread CTA each.
  constexpr int threads = GROUP == 32 ? 128 : AP_THREADS, per_cta = threads / GROUP;
  static_assert(GROUP == 32 || GROUP == AP_THREADS, "a warp or the whole CTA a request");
  const size_t smem = per_cta * ap_row_bytes(D);  // <= 48 KB: no opt-in needed
  accept_parents_kernel<GROUP, SLOTS><<<ceil_div(B, per_cta), threads, smem, st>>>(
      candidates, parents, node_counts, target, B, D, max_depth, accept_index, accept_len, bonus);
  KD_LAUNCH_CHECK();
  return 0;
}

}  // namespace
}  // namespace kd

extern "C" int kd_tree_accept_parents(const int64_t* candidates, const int32_t* parents,
                                      const int32_t* node_counts, const int64_t* target, int B,
                                      int D, int max_depth, int32_t* accept_index,
                                      int32_t* accept_len, int64_t* bonus, void* stream) {
  using namespace kd;
  if (B < 0 || D < 1 || D > AP_MAX_SLOTS || max_depth < 0) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  cudaStream_t st = (cudaStream_t)stream;
#define KD_AP_ARGS candidates, parents, node_counts, target, B, D, max_depth, accept_index, \
                   accept_len, bonus, st
  if (D <= 64) return launch<32, 2>(KD_AP_ARGS);
  if (D <= 2 * AP_THREADS) return launch<AP_THREADS, 2>(KD_AP_ARGS);
  if (D <= 5 * AP_THREADS) return launch<AP_THREADS, 5>(KD_AP_ARGS);  // budget 1024 (D 1025)
  return launch<AP_THREADS, AP_MAX_SLOTS / AP_THREADS>(KD_AP_ARGS);
#undef KD_AP_ARGS
}
