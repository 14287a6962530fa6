// Best-first DDTree build on the GPU (spec ddtree.md, sections 2-4).
//
// One CTA per request. Warp 0 runs the selection (tree_select.cuh: the frontier's best
// 32 entries sorted across the lanes, the rest in shared memory), so the pop order is the
// reference's by construction: score (float64, __dsub_rn/__dadd_rn, no FMA contraction)
// first, then the lexicographically smaller rank path (a 256-bit key per popped node when
// L <= 16, else a walk up the parent pointers). While the batch fits one CTA per SM, the
// request's log-probs are staged in shared memory first (the pops read them on their
// critical path). The outputs (links, positions, ancestor-closure masks) are then written
// by the whole CTA in parallel.
#include <vector>

#include "tree_select.cuh"

namespace kd {
namespace {

constexpr int BUILD_THREADS = 256;
constexpr int MAX_SLOTS = 1025;  // budget 1024 + root
constexpr size_t LP_SMEM_MAX = 64 * 1024;  // staged log-probs; larger requests read global

__global__ void __launch_bounds__(BUILD_THREADS)
build_trees_kernel(const float* __restrict__ top_lp, const int64_t* __restrict__ top_ids,
                   const int32_t* __restrict__ budgets, const int32_t* __restrict__ prefix_lens,
                   const int64_t* __restrict__ root_tokens, int L, int K, int D,
                   int32_t* __restrict__ node_counts, int64_t* __restrict__ tokens,
                   int64_t* __restrict__ depths, int32_t* __restrict__ parents,
                   int64_t* __restrict__ positions, int64_t* __restrict__ next_token,
                   int64_t* __restrict__ next_sibling, uint8_t* __restrict__ visibility,
                   int32_t* __restrict__ visibility_bits, int32_t* __restrict__ status,
                   int lp_ld, int use_keys) {
  // Dynamic shared memory: path keys [D][4] (if use_keys), then the staged log-probs
  // (ranks [0, lp_ld) of every depth, if lp_ld > 0).
  extern __shared__ __align__(16) unsigned char s_dyn[];
  uint64_t* s_keys = use_keys ? reinterpret_cast<uint64_t*>(s_dyn) : nullptr;
  float* s_lp = reinterpret_cast<float*>(s_dyn + (use_keys ? (size_t)D * KEY_WORDS * 8 : 0));
  __shared__ Entry s_overflow[MAX_SLOTS];
  __shared__ uint32_t s_nodes[MAX_SLOTS];
  __shared__ int16_t s_links[3][MAX_SLOTS];
  __shared__ int s_n;
  const int b = blockIdx.x, tid = threadIdx.x;
  const Selection sel{s_overflow, s_nodes, s_keys, s_links[0], s_links[1], s_links[2]};

  const float* lp = top_lp + (size_t)b * L * K;
  const int64_t* ids = top_ids + (size_t)b * L * K;
  int flags = 0;
  int budget = budgets[b];
  if (budget > D - 1) { budget = D - 1; flags |= KD_STATUS_BUDGET_CLAMPED; }

  // NaN / +inf anywhere in the request's log-probs: refuse the request (root-only tree).
  // One flat loop, unrolled: the loads are independent, so they overlap.
  bool bad = false;
#pragma unroll 4
  for (int i = tid; i < L * K; i += blockDim.x) {
    const float v = lp[i];
    bad |= (v != v) || (v == INFINITY);
    const int d = i / K, r = i - d * K;
    if (r < lp_ld) s_lp[d * lp_ld + r] = v;
  }
  if (__syncthreads_or(bad)) { flags |= KD_STATUS_NAN_INPUT; budget = 0; }

  for (int i = tid; i < D; i += blockDim.x) {
    sel.next_token[i] = -1; sel.next_sibling[i] = -1; sel.last_child[i] = -1;
  }
  if (tid == 0) s_nodes[0] = pack_node(0, 0, 0);
  if (use_keys && tid < KEY_WORDS) s_keys[tid] = 0;  // the root's path is empty
  __syncthreads();
  if (tid < 32) {
    const int n = lp_ld > 0 ? select_nodes(s_lp, lp_ld, L, K, budget, sel)
                            : select_nodes(lp, K, L, K, budget, sel);
    if (tid == 0) s_n = n;
  }
  __syncthreads();
  const int n = s_n;
  const int64_t prefix = prefix_lens ? prefix_lens[b] : 0;

  // Per-slot arrays; padding slots are unreachable leaves of the root.
  const size_t row0 = (size_t)b * D;
  for (int i = tid; i < D; i += blockDim.x) {
    const bool live = i <= n;
    const uint32_t node = s_nodes[i];
    const int depth = i == 0 ? 0 : (live ? node_depth(node) : 1);
    int64_t tok;
    if (i == 0) tok = root_tokens ? root_tokens[b] : PAD_TOKEN;
    else tok = live ? ids[(size_t)(depth - 1) * K + node_rank(node)] : PAD_TOKEN;
    tokens[row0 + i] = tok;
    depths[row0 + i] = depth;
    parents[row0 + i] = i == 0 ? -1 : (live ? node_parent(node) : 0);
    positions[row0 + i] = prefix + depth;
    next_token[row0 + i] = live ? sel.next_token[i] : -1;
    next_sibling[row0 + i] = live ? sel.next_sibling[i] : -1;
  }
  if (tid == 0) { node_counts[b] = n; status[b] = flags; }

  // Visibility rows: one warp per row; lane w owns words w and w + 32 (D <= 1025 -> W <= 33).
  const int W = ceil_div(D, 32);
  const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  for (int i = warp; i < D; i += nwarps) {
    uint32_t w0 = 0, w1 = 0;
    int a = i;
    if (i > n) {  // padding row: root + itself
      if ((i >> 5) == lane) w0 |= 1u << (i & 31);
      if ((i >> 5) == lane + 32) w1 |= 1u << (i & 31);
      a = 0;
    }
    for (int guard = 0; a >= 0 && guard <= D; ++guard) {  // a chain is at most D long
      const int w = a >> 5;
      if (w == lane) w0 |= 1u << (a & 31);
      if (w == lane + 32) w1 |= 1u << (a & 31);
      a = a == 0 ? -1 : node_parent(s_nodes[a]);
    }
    const size_t vrow = ((size_t)b * D + i);
    if (visibility_bits) {
      if (lane < W) visibility_bits[vrow * W + lane] = (int32_t)w0;
      if (lane + 32 < W) visibility_bits[vrow * W + lane + 32] = (int32_t)w1;
    }
    if (visibility) {
      for (int base = 0; base < D; base += 32) {
        const int word = base >> 5;
        const uint32_t bits = __shfl_sync(0xffffffffu, word < 32 ? w0 : w1, word & 31);
        const int j = base + lane;
        if (j < D) visibility[vrow * D + j] = (bits >> lane) & 1u;
      }
    }
  }
}

}  // namespace
}  // namespace kd

extern "C" int kd_build_trees(const float* top_lp, const int64_t* top_ids, const int32_t* budgets,
                              const int32_t* prefix_lens, const int64_t* root_tokens, int B,
                              int L, int K, int D, int32_t* node_counts, int64_t* tokens,
                              int64_t* depths, int32_t* parents, int64_t* positions,
                              int64_t* next_token, int64_t* next_sibling, uint8_t* visibility,
                              int32_t* visibility_bits, int32_t* status, void* stream) {
  if (B < 0 || L < 0 || K < 0 || D < 1 || D > kd::MAX_SLOTS || L > kd::MAX_DEPTH) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  // Dynamic shared memory, as far as this device allows per block: path keys first
  // (they make ties cheap), then the staged log-probs (budgets are clamped to D - 1, so
  // no request reads ranks past min(K, D - 1)).
  int dev = 0, optin = 0;
  cudaFuncAttributes fa;
  cudaError_t e = cudaGetDevice(&dev);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kd::build_trees_kernel);
  if (e != cudaSuccess) return (int)e;
  const size_t room = (size_t)optin > fa.sharedSizeBytes ? optin - fa.sharedSizeBytes : 0;
  const size_t key_bytes = (size_t)D * kd::KEY_WORDS * sizeof(uint64_t);
  const int use_keys = L <= kd::KEY_DEPTH && key_bytes <= room;
  int lp_ld = K < D - 1 ? K : D - 1;
  size_t lp_bytes = (size_t)L * lp_ld * sizeof(float);
  const size_t smem_keys = use_keys ? key_bytes : 0;
  // Staging buys a faster pop but costs residency: with more requests than SMs, keep
  // CTAs small so that every request of the batch runs at once (B 256 x budget 1024 ran
  // two waves and took twice v1's time with the log-probs staged).
  int sms = 0;
  e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (e != cudaSuccess) return (int)e;
  if (lp_bytes > kd::LP_SMEM_MAX || smem_keys + lp_bytes > room || B > sms) { lp_ld = 0; lp_bytes = 0; }
  const size_t smem = smem_keys + lp_bytes;
  if (smem > 0) {
    e = cudaFuncSetAttribute(kd::build_trees_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return (int)e;
  }
  kd::build_trees_kernel<<<B, kd::BUILD_THREADS, smem, (cudaStream_t)stream>>>(
      top_lp, top_ids, budgets, prefix_lens, root_tokens, L, K, D, node_counts, tokens, depths,
      parents, positions, next_token, next_sibling, visibility, visibility_bits, status, lp_ld, use_keys);
  KD_LAUNCH_CHECK();
  return 0;
}

extern "C" int kd_version(void) { return 2; }

// The kernel's selection, run on the host over one request (for CPU-only checks).
extern "C" int kd_select_nodes_host(const float* top_lp, int L, int K, int budget,
                                    int32_t* parents, int32_t* ranks, int32_t* depths) {
  if (L < 0 || K < 0 || budget > 1024 || L > kd::MAX_DEPTH) return -1;
  const int D = (budget > 0 ? budget : 0) + 1;
  std::vector<kd::Entry> overflow(D);
  std::vector<uint32_t> nodes(D, kd::pack_node(0, 0, 0));
  std::vector<uint64_t> keys((size_t)D * kd::KEY_WORDS, 0);
  std::vector<int16_t> links(3 * (size_t)D, -1);
  const kd::Selection sel{overflow.data(), nodes.data(),
                          L <= kd::KEY_DEPTH ? keys.data() : nullptr, links.data(), links.data() + D,
                          links.data() + 2 * D};
  const int n = kd::select_nodes(top_lp, K, L, K, budget, sel);
  parents[0] = -1; ranks[0] = 0; depths[0] = 0;
  for (int i = 1; i <= n; ++i) {
    parents[i] = kd::node_parent(nodes[i]); ranks[i] = kd::node_rank(nodes[i]);
    depths[i] = kd::node_depth(nodes[i]);
  }
  return n;
}
