// Best-first DDTree build on the GPU (spec ddtree.md, sections 2-4).
//
// One CTA per request. Selection is the spec's heap, run by one thread over
// shared memory, so the pop order is the reference's by construction: score
// (float64, __dsub_rn/__dadd_rn, no FMA contraction) first, then the
// lexicographically smaller rank path, compared through the parent pointers
// of popped nodes (no path digits to pack). The outputs (links, positions,
// ancestor-closure masks) are then written by the whole CTA in parallel.
#include "common.cuh"

namespace kd {
namespace {

constexpr int BUILD_THREADS = 256;

struct Heap {
  double* score;
  int16_t* parent;
  int16_t* rank;
  int16_t* depth;
};

struct Nodes {  // popped nodes; node 0 is the root (depth 0)
  int16_t* parent;
  int16_t* rank;
  int16_t* depth;
  int16_t* next_token;
  int16_t* next_sibling;
  int16_t* last_child;
};

// Rank path of candidate a < that of candidate b (a proper prefix is smaller).
__device__ bool path_less(const Nodes& nd, int pa, int ra, int da, int pb, int rb, int db) {
  const int da0 = da, db0 = db;
  while (da > db) { ra = nd.rank[pa]; pa = nd.parent[pa]; --da; }
  while (db > da) { rb = nd.rank[pb]; pb = nd.parent[pb]; --db; }
  if (pa == pb && ra == rb) return da0 < db0;  // one path is a prefix of the other
  while (pa != pb) {
    ra = nd.rank[pa]; pa = nd.parent[pa];
    rb = nd.rank[pb]; pb = nd.parent[pb];
  }
  return ra < rb;
}

__device__ bool better(const Heap& h, const Nodes& nd, int x, int y) {
  const double sx = h.score[x], sy = h.score[y];
  if (sx != sy) return sx > sy;
  return path_less(nd, h.parent[x], h.rank[x], h.depth[x], h.parent[y], h.rank[y], h.depth[y]);
}

__device__ void heap_swap(const Heap& h, int a, int b) {
  double s = h.score[a]; h.score[a] = h.score[b]; h.score[b] = s;
  int16_t t;
  t = h.parent[a]; h.parent[a] = h.parent[b]; h.parent[b] = t;
  t = h.rank[a]; h.rank[a] = h.rank[b]; h.rank[b] = t;
  t = h.depth[a]; h.depth[a] = h.depth[b]; h.depth[b] = t;
}

__device__ void sift_down(const Heap& h, const Nodes& nd, int size) {
  int i = 0;
  while (true) {
    int best = i, l = 2 * i + 1, r = l + 1;
    if (l < size && better(h, nd, l, best)) best = l;
    if (r < size && better(h, nd, r, best)) best = r;
    if (best == i) return;
    heap_swap(h, i, best);
    i = best;
  }
}

__device__ void sift_up(const Heap& h, const Nodes& nd, int i) {
  while (i > 0) {
    int p = (i - 1) / 2;
    if (!better(h, nd, i, p)) return;
    heap_swap(h, i, p);
    i = p;
  }
}

__device__ __forceinline__ double load_lp(const float* lp, int K, int d, int r) {
  float v = lp[(size_t)d * K + r];
  if (v == -INFINITY) v = NEG_INF_FLOOR;  // spec policy, identical to kdtree.checks
  return (double)v;
}

// Thread 0: the heap loop. Returns the node count n.
__device__ int select_nodes(const float* lp, int L, int K, int budget, Heap h, Nodes nd) {
  const int Keff = min(budget, K);
  if (budget <= 0 || L == 0 || Keff == 0) return 0;
  int size = 1, n = 0;
  h.score[0] = load_lp(lp, K, 0, 0);
  h.parent[0] = 0; h.rank[0] = 0; h.depth[0] = 1;
  while (size > 0 && n < budget) {
    const double s = h.score[0];
    const int parent = h.parent[0], rank = h.rank[0], depth = h.depth[0];
    ++n;
    nd.parent[n] = (int16_t)parent; nd.rank[n] = (int16_t)rank; nd.depth[n] = (int16_t)depth;
    const int last = nd.last_child[parent];
    if (last < 0) nd.next_token[parent] = (int16_t)n; else nd.next_sibling[last] = (int16_t)n;
    nd.last_child[parent] = (int16_t)n;
    // The sibling replaces the popped top (same heap content as pop + push: the order is total).
    if (rank + 1 < Keff) {
      h.score[0] = __dadd_rn(__dsub_rn(s, load_lp(lp, K, depth - 1, rank)),
                             load_lp(lp, K, depth - 1, rank + 1));
      h.rank[0] = (int16_t)(rank + 1);
    } else {
      --size;
      if (size > 0) {
        h.score[0] = h.score[size]; h.parent[0] = h.parent[size];
        h.rank[0] = h.rank[size]; h.depth[0] = h.depth[size];
      }
    }
    if (size > 1) sift_down(h, nd, size);
    if (depth < L) {
      h.score[size] = __dadd_rn(s, load_lp(lp, K, depth, 0));
      h.parent[size] = (int16_t)n; h.rank[size] = 0; h.depth[size] = (int16_t)(depth + 1);
      sift_up(h, nd, size);
      ++size;
    }
  }
  return n;
}

__global__ void __launch_bounds__(BUILD_THREADS)
build_trees_kernel(const float* __restrict__ top_lp, const int64_t* __restrict__ top_ids,
                   const int32_t* __restrict__ budgets, const int32_t* __restrict__ prefix_lens,
                   const int64_t* __restrict__ root_tokens, int L, int K, int D,
                   int32_t* __restrict__ node_counts, int64_t* __restrict__ tokens,
                   int64_t* __restrict__ depths, int32_t* __restrict__ parents,
                   int64_t* __restrict__ positions, int64_t* __restrict__ next_token,
                   int64_t* __restrict__ next_sibling, uint8_t* __restrict__ visibility,
                   int32_t* __restrict__ visibility_bits, int32_t* __restrict__ status) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int b = blockIdx.x, tid = threadIdx.x;
  Heap h;
  Nodes nd;
  h.score = reinterpret_cast<double*>(smem);
  int16_t* p16 = reinterpret_cast<int16_t*>(h.score + D);
  h.parent = p16; h.rank = p16 + D; h.depth = p16 + 2 * D;
  nd.parent = p16 + 3 * D; nd.rank = p16 + 4 * D; nd.depth = p16 + 5 * D;
  nd.next_token = p16 + 6 * D; nd.next_sibling = p16 + 7 * D; nd.last_child = p16 + 8 * D;
  __shared__ int s_n;

  const float* lp = top_lp + (size_t)b * L * K;
  const int64_t* ids = top_ids + (size_t)b * L * K;
  int flags = 0;
  int budget = budgets[b];
  if (budget > D - 1) { budget = D - 1; flags |= KD_STATUS_BUDGET_CLAMPED; }

  // NaN / +inf anywhere in the request's log-probs: refuse the request (root-only tree).
  bool bad = false;
  for (int i = tid; i < L * K; i += blockDim.x) {
    const float v = lp[i];
    bad |= (v != v) || (v == INFINITY);
  }
  if (__syncthreads_or(bad)) { flags |= KD_STATUS_NAN_INPUT; budget = 0; }

  for (int i = tid; i < D; i += blockDim.x) {
    nd.next_token[i] = -1; nd.next_sibling[i] = -1; nd.last_child[i] = -1;
  }
  if (tid == 0) { nd.parent[0] = -1; nd.rank[0] = 0; nd.depth[0] = 0; }
  __syncthreads();
  if (tid == 0) s_n = select_nodes(lp, L, K, budget, h, nd);
  __syncthreads();
  const int n = s_n;
  const int64_t prefix = prefix_lens ? prefix_lens[b] : 0;

  // Per-slot arrays; padding slots are unreachable leaves of the root.
  const size_t row0 = (size_t)b * D;
  for (int i = tid; i < D; i += blockDim.x) {
    const bool live = i <= n;
    const int depth = i == 0 ? 0 : (live ? nd.depth[i] : 1);
    int64_t tok;
    if (i == 0) tok = root_tokens ? root_tokens[b] : PAD_TOKEN;
    else tok = live ? ids[(size_t)(depth - 1) * K + nd.rank[i]] : PAD_TOKEN;
    tokens[row0 + i] = tok;
    depths[row0 + i] = depth;
    parents[row0 + i] = i == 0 ? -1 : (live ? nd.parent[i] : 0);
    positions[row0 + i] = prefix + depth;
    next_token[row0 + i] = live ? nd.next_token[i] : -1;
    next_sibling[row0 + i] = live ? nd.next_sibling[i] : -1;
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
    while (a >= 0) {
      const int w = a >> 5;
      if (w == lane) w0 |= 1u << (a & 31);
      if (w == lane + 32) w1 |= 1u << (a & 31);
      a = nd.parent[a];
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
  if (B < 0 || L < 0 || K < 0 || D < 1 || D > 1025 || L > 32767) return KD_ERR_ARGUMENT;
  if (B == 0) return 0;
  const size_t smem = (size_t)D * (sizeof(double) + 9 * sizeof(int16_t));
  cudaError_t e = cudaFuncSetAttribute(kd::build_trees_kernel,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (e != cudaSuccess) return (int)e;
  kd::build_trees_kernel<<<B, kd::BUILD_THREADS, smem, (cudaStream_t)stream>>>(
      top_lp, top_ids, budgets, prefix_lens, root_tokens, L, K, D, node_counts, tokens, depths,
      parents, positions, next_token, next_sibling, visibility, visibility_bits, status);
  KD_LAUNCH_CHECK();
  return 0;
}

extern "C" int kd_version(void) { return 1; }
