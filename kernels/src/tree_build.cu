// DDTree build on the GPU (spec ddtree.md, sections 2-4), one CTA per request.
//
// Selection, fast path (tree_threshold.cuh): the whole CTA selects the top-`budget` nodes
// by threshold and sorts them, exact under a certificate checked on the way (sorted rows,
// exact float64 sums). Where the certificate fails (or L > 16, or the device's shared
// memory is too small for the node buffer), warp 0 runs the heap-exact loop instead
// (tree_select.cuh: the frontier's best 32 entries sorted across the lanes), whose pops
// are the reference's by construction. Both produce the pop order, parents and the
// left-child / right-sibling links; the outputs (tokens, positions, ancestor-closure
// masks) are then written by the whole CTA in parallel.
#include <vector>

#include "tree_threshold.cuh"

// 0 builds a plain launch (for same-run A/Bs against the programmatic one, kd_build_trees).
#ifndef KD_BUILD_PDL
#define KD_BUILD_PDL 1
#endif
// Ancestor rows of up to this many words built in registers where only the bits are asked
// for (1: only rows of one word, for same-run A/Bs).
#ifndef KD_BUILD_REG_ROW_WORDS
#define KD_BUILD_REG_ROW_WORDS 4
#endif

namespace kd {
namespace {

constexpr int BUILD_THREADS = 512;
constexpr int MAX_SLOTS = 1025;  // budget 1024 + root
constexpr size_t LP_SMEM_MAX = 64 * 1024;  // staged log-probs (loop mode)
constexpr int REG_ROW_WORDS = KD_BUILD_REG_ROW_WORDS;
static_assert(REG_ROW_WORDS >= 1 && REG_ROW_WORDS <= 8, "rows of one to eight words in registers");

// Bits b0..b3 of x as the bytes 0/1 of a word (little-endian: bit k -> byte k).
__device__ __forceinline__ uint32_t spread4(uint32_t x) { return ((x & 0xfu) * 0x00204081u) & 0x01010101u; }

// Bit (i, j) of the D x D ancestor matrix, rows of W words.
__device__ __forceinline__ uint8_t vis_bit(const uint32_t* bits, int W, int i, int j) {
  return (bits[i * W + (j >> 5)] >> (j & 31)) & 1u;
}

// Calls f(a) for slot i and each of its ancestors up to the root (a padding slot, i > n,
// is an unreachable leaf of the root). At most D steps, whatever the parents say.
template <class F>
__device__ __forceinline__ void for_each_ancestor(const uint32_t* nodes, int i, int n, int D, F f) {
  f(i);
  for (int a = i == 0 ? -1 : (i <= n ? node_parent(nodes[i]) : 0), guard = 0; a >= 0 && guard < D; ++guard) {
    f(a);
    a = a == 0 ? -1 : node_parent(nodes[a]);
  }
}

// 16 bits of row i of the D x D bit matrix from column j (bits past D are 0 in a row).
__device__ __forceinline__ uint32_t row_bits16(const uint32_t* bits, int W, int i, int j) {
  const int w = j >> 5;
  const uint32_t lo = bits[i * W + w], hi = w + 1 < W ? bits[i * W + w + 1] : 0u;
  return __funnelshift_r(lo, hi, j & 31) & 0xffffu;
}

// The request's bool matrix (D * D bytes from `out`, any alignment) from its bit rows:
// 16-byte stores over the aligned body, bytes at the two ends. A thread's chunks are
// nthreads * 16 bytes apart, so its (row, column) advances by a fixed step (one division
// at the start, not one a chunk: v3c spent most of this phase on divisions), and a chunk
// that crosses a row end joins the tail of one row with the head of the next.
__device__ void write_visibility_bytes(uint8_t* out, const uint32_t* bits, int D, int W, int tid, int nthreads) {
  const int total = D * D;
  int head = (int)((16 - ((uintptr_t)out & 15)) & 15);
  if (head > total) head = total;
  const int chunks = (total - head) >> 4, tail = head + (chunks << 4);
  // The two ends are under 16 bytes: from D = 16 in the first and the last row, so no
  // divisions (their code alone was ~160 instructions to fetch at the kernel's end).
  for (int f = tid; f < head; f += nthreads) out[f] = D >= 16 ? vis_bit(bits, W, 0, f) : vis_bit(bits, W, f / D, f % D);
  for (int f = tail + tid; f < total; f += nthreads)
    out[f] = D >= 16 ? vis_bit(bits, W, D - 1, f - (total - D)) : vis_bit(bits, W, f / D, f % D);
  uint4* body = reinterpret_cast<uint4*>(out + head);
  const int stride = nthreads << 4, di = small_div(stride, D), dj = stride - di * D;
  int i = small_div(head + (tid << 4), D), j = head + (tid << 4) - i * D;
  for (int c = tid; c < chunks; c += nthreads) {
    uint32_t x = row_bits16(bits, W, i, j);  // the 16 bits of bytes f .. f + 15
    if (j + 16 > D) {
      if (D >= 16) {
        x |= (row_bits16(bits, W, i + 1, 0) << (D - j)) & 0xffffu;
      } else {  // tiny trees: a chunk may span several rows
        x = 0;
        for (int k = 0, ii = i, jj = j; k < 16; ++k) {
          x |= (uint32_t)vis_bit(bits, W, ii, jj) << k;
          if (++jj == D) { jj = 0; ++ii; }
        }
      }
    }
    body[c] = make_uint4(spread4(x), spread4(x >> 4), spread4(x >> 8), spread4(x >> 12));
    i += di;
    j += dj;
    if (j >= D) { j -= D; ++i; }
  }
}

// mode: 0 = warp loop only (path keys at the start of dynamic shared memory if use_keys,
// then the log-probs if lp_ld > 0); ts_cap > 0 = threshold selection with a node buffer
// of ts_cap (views from ts_views; log-probs staged with row stride lp_ld), falling back
// to the warp loop on global log-probs, its path keys over the node buffer.
// WIDE: one CTA an SM, up to 128 registers (no spills) and the linear raise, where each
// request has an SM to itself anyway; else no minimum (0), where ptxas holds the kernel to
// 64 registers so that two requests share an SM (wide_kernel picks).
template <bool WIDE>
__global__ void __launch_bounds__(BUILD_THREADS, WIDE ? 1 : 0)
build_trees_kernel(const float* __restrict__ top_lp, const int64_t* __restrict__ top_ids,
                   const int32_t* __restrict__ budgets, const int32_t* __restrict__ prefix_lens,
                   const int64_t* __restrict__ root_tokens, int L, int K, int D,
                   int32_t* __restrict__ node_counts, int64_t* __restrict__ tokens,
                   int64_t* __restrict__ depths, int32_t* __restrict__ parents,
                   int64_t* __restrict__ positions, int64_t* __restrict__ next_token,
                   int64_t* __restrict__ next_sibling, uint8_t* __restrict__ visibility,
                   int32_t* __restrict__ visibility_bits, int32_t* __restrict__ status,
                   int lp_ld, int use_keys, int ts_cap, int vis_smem) {
  extern __shared__ __align__(16) unsigned char s_dyn[];
  __shared__ Entry s_overflow[MAX_SLOTS];
  __shared__ uint32_t s_nodes[MAX_SLOTS];
  __shared__ int16_t s_links[3][MAX_SLOTS];
  __shared__ int s_n;
  const int b = blockIdx.x, tid = threadIdx.x;
#if KD_BUILD_PDL
  pdl_wait();  // a programmatic dependent: the kernel before may still be draining
#endif
  KD_PROF(0);
#if defined(KD_BUILD_PROFILE) && defined(__CUDA_ARCH__)
  const long long t_begin = clock64();
#endif
  const bool threshold = ts_cap > 0;
  const Threshold ts = ts_views(s_dyn, L, lp_ld, threshold ? ts_cap : TS_MIN_NODES);
  // Warp-loop views: its keys sit over the node buffer in threshold mode.
  uint64_t* s_keys = !use_keys ? nullptr
                     : threshold ? reinterpret_cast<uint64_t*>(ts.items) : reinterpret_cast<uint64_t*>(s_dyn);
  float* s_lp = threshold ? ts.lp : reinterpret_cast<float*>(s_dyn + (use_keys ? (size_t)D * KEY_WORDS * 8 : 0));
  const int s_ld = threshold ? ts.ld : lp_ld;  // row stride of s_lp (ts_stride: odd)
  const Selection sel{s_overflow, s_nodes, s_keys, s_links[0], s_links[1], s_links[2]};

  const float* lp = top_lp + (size_t)b * L * K;
  const int64_t* ids = top_ids + (size_t)b * L * K;
  int flags = 0;
  int budget = budgets[b];
  if (budget > D - 1) { budget = D - 1; flags |= KD_STATUS_BUDGET_CLAMPED; }
  const int keff = budget < K ? budget : K;

  // NaN / +inf anywhere in the request's log-probs: refuse the request (root-only tree).
  // The same pass stages ranks < lp_ld (-inf clamped in threshold mode) and checks the
  // threshold certificate on ranks < keff: rank 0 <= 0, each <= the one before (read again
  // from global memory where it is another thread's: no second pass, no extra barrier).
  bool bad = false, uncertified = false;
  const float clamp_floor = threshold ? NEG_INF_FLOOR : -INFINITY;  // the warp loop clamps itself
  if ((K & 3) == 0 && ((uintptr_t)lp & 15) == 0 && lp_ld > 0) {
    // Four ranks a load (K % 4 == 0: a vector never straddles two depths).
    const float4* lp4 = reinterpret_cast<const float4*>(lp);
    for (int i = tid; i < (L * K) >> 2; i += blockDim.x) {
      const float4 v = lp4[i];
      const int d = (i << 2) / K, r = (i << 2) - d * K;
      const float e[4] = {v.x, v.y, v.z, v.w};
      float prev = r == 0 ? 0.0f : fmaxf(lp[(i << 2) - 1], clamp_floor);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        bad |= (e[k] != e[k]) || (e[k] == INFINITY);
        const float c = fmaxf(e[k], clamp_floor);
        if (r + k < lp_ld) s_lp[d * s_ld + r + k] = c;
        uncertified |= r + k < keff && !(c <= prev);
        prev = c;
      }
    }
  } else {
#pragma unroll 4
    for (int i = tid; i < L * K; i += blockDim.x) {
      const float v = lp[i];
      bad |= (v != v) || (v == INFINITY);
      const int d = i / K, r = i - d * K;
      const float c = fmaxf(v, clamp_floor);
      if (r < lp_ld) s_lp[d * s_ld + r] = c;
      if (r < keff) uncertified |= !(c <= (r == 0 ? 0.0f : fmaxf(lp[i - 1], clamp_floor)));
    }
  }
  uncertified &= threshold;
  if (__syncthreads_or(bad)) { flags |= KD_STATUS_NAN_INPUT; budget = 0; }
  uncertified = __syncthreads_or(uncertified) || L > KEY_DEPTH;
  KD_PROF(1);

  for (int i = tid; i < D; i += blockDim.x) {
    sel.next_token[i] = -1; sel.next_sibling[i] = -1; sel.last_child[i] = -1;
  }
  if (tid == 0) s_nodes[0] = pack_node(0, 0, 0);
  __syncthreads();
  int n = -1;
  const int batch = gridDim.x;
  const int start = start_bound(batch, budget, keff);  // the batch gate (tree_heuristics.cuh)
  if (threshold && !uncertified)
    n = threshold_select<WIDE>(ts, L, K, budget, sel, tid, blockDim.x, nullptr, start);
  if (n < 0) {  // the warp loop: exact for any input
    if (budget > 0) flags |= KD_STATUS_WARP_LOOP;
    __syncthreads();
    if (threshold)
      for (int i = tid; i < D; i += blockDim.x) { sel.next_token[i] = -1; sel.next_sibling[i] = -1; }
    if (use_keys && tid < KEY_WORDS) s_keys[tid] = 0;  // the root's path is empty
    __syncthreads();
    if (tid < 32) {
      const int m = lp_ld > 0 && !threshold ? select_nodes(s_lp, lp_ld, L, K, budget, sel)
                                            : select_nodes(lp, K, L, K, budget, sel);
      if (tid == 0) s_n = m;
    }
    __syncthreads();
    n = s_n;
  }

  KD_PROF(5);
  const int64_t prefix = prefix_lens ? prefix_lens[b] : 0;

  // Per-slot arrays; padding slots are unreachable leaves of the root. With vis_smem the
  // same pass builds the ancestor rows as bits in shared memory, over the selection's
  // buffers (dead: every path ends its selection with a barrier after its last read): a
  // thread per row walks up its chain (at most L steps); rows of one word (D <= 32) go
  // out from registers, no shared memory or barrier. One pass, not two with a barrier
  // between: at the kernel's end each new stretch of code is an instruction-cache miss
  // (ncu, B 64 x 16: "no instruction" was 27% of the stall samples, most of them here).
  const size_t row0 = (size_t)b * D;
  const int W = ceil_div(D, 32);
  // Rows of 2 .. REG_ROW_WORDS words go out from registers too where only the bits are
  // asked for (the dense bytes' 16-byte writer reads the rows in shared memory): no
  // read-modify-write a step of the walk, no barrier, no second pass.
  const bool reg_words = REG_ROW_WORDS > 1 && W > 1 && W <= REG_ROW_WORDS && !visibility;
  uint32_t* s_bits = reinterpret_cast<uint32_t*>(s_dyn);
  for (int i = tid; i < D; i += blockDim.x) {
    const bool live = i <= n;
    const uint32_t node = s_nodes[i];
    const int depth = i == 0 ? 0 : (live ? node_depth(node) : 1);
    // The token's load is issued first and stored last: the ancestor walk (up to L
    // dependent shared loads) runs under its global round trip instead of after it.
    int64_t tok;
    if (i == 0) tok = root_tokens ? root_tokens[b] : PAD_TOKEN;
    else tok = live ? ids[(size_t)(depth - 1) * K + node_rank(node)] : PAD_TOKEN;
    if (W == 1) {  // D <= 32: a row is one word; both outputs straight from a register
      uint32_t row = 0;
      for_each_ancestor(s_nodes, i, n, D, [&](int a) { row |= 1u << a; });
      if (visibility_bits) visibility_bits[row0 + i] = (int32_t)row;
      if (visibility) {
        uint8_t* out = visibility + (row0 + i) * D;
        for (int j = 0; j < D; ++j) out[j] = (row >> j) & 1u;
      }
    } else if (reg_words) {  // bits only, 2 .. REG_ROW_WORDS words
      uint32_t r[REG_ROW_WORDS] = {};  // indexed by constants only: registers
      for_each_ancestor(s_nodes, i, n, D, [&](int a) {
        const uint32_t bit = 1u << (a & 31);
#pragma unroll
        for (int w = 0; w < REG_ROW_WORDS; ++w) r[w] |= (a >> 5) == w ? bit : 0u;
      });
      if (visibility_bits) {
        int32_t* vb = visibility_bits + (row0 + i) * W;
#pragma unroll
        for (int w = 0; w < REG_ROW_WORDS; ++w)
          if (w < W) vb[w] = (int32_t)r[w];
      }
    } else if (vis_smem) {
      uint32_t* row = s_bits + (size_t)i * W;
      for (int w = 0; w < W; ++w) row[w] = 0;
      for_each_ancestor(s_nodes, i, n, D, [&](int a) { row[a >> 5] |= 1u << (a & 31); });
    }
    depths[row0 + i] = depth;
    parents[row0 + i] = i == 0 ? -1 : (live ? node_parent(node) : 0);
    positions[row0 + i] = prefix + depth;
    next_token[row0 + i] = live ? sel.next_token[i] : -1;
    next_sibling[row0 + i] = live ? sel.next_sibling[i] : -1;
    tokens[row0 + i] = tok;
  }
  if (tid == 0) { node_counts[b] = n; status[b] = flags; }
  KD_PROF(6);

  // Rows in registers went out above.
  if (W > 1 && !reg_words && vis_smem) {
    __syncthreads();
    KD_PROF(7);
    if (visibility_bits) {
      int32_t* vb = visibility_bits + (size_t)b * D * W;
      for (int i = tid; i < D * W; i += blockDim.x) vb[i] = (int32_t)s_bits[i];
    }
    if (visibility) write_visibility_bytes(visibility + (size_t)b * D * D, s_bits, D, W, tid, blockDim.x);
  } else if (W > 1 && !reg_words) {
    // Visibility rows: one warp per row; lane w owns words w and w + 32 (D <= 1025 -> W <= 33).
    const int lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    for (int i = warp; i < D; i += nwarps) {
      uint32_t w0 = 0, w1 = 0;
      for_each_ancestor(s_nodes, i, n, D, [&](int a) {
        const int w = a >> 5;
        if (w == lane) w0 |= 1u << (a & 31);
        if (w == lane + 32) w1 |= 1u << (a & 31);
      });
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
  KD_PROF(8);
#if defined(KD_BUILD_PROFILE) && defined(__CUDA_ARCH__)
  if (tid == 0 && b < KD_PROF_BLOCKS) g_block_cycles[b] = clock64() - t_begin;
#endif
}

}  // namespace
}  // namespace kd

namespace {
// Per-device launch facts, read once (the launch path stays free of attribute queries).
struct BuildFacts {
  size_t room;       // dynamic shared memory a block may use
  size_t smem_sm;    // shared memory an SM holds
  size_t cta_fixed;  // the two-CTA kernel's static shared memory and the system's reserve
  int sms;
  int pdl;  // launch as a programmatic dependent (9.x: measured there only)
  int ready;
};
BuildFacts g_facts[kd::MAX_DEVICES];
int g_smem_limit = 0;  // bytes of dynamic shared memory the build may use; 0: the device's

int build_facts(BuildFacts** out) {
  const kd::DeviceFacts* d = nullptr;
  int rc = kd::device_facts(&d);
  if (rc != 0) return rc;
  BuildFacts& f = g_facts[d->device];
  if (!f.ready) {
    cudaFuncAttributes fa, fn;
    cudaError_t e = cudaFuncGetAttributes(&fa, kd::build_trees_kernel<true>);
    if (e == cudaSuccess) e = cudaFuncGetAttributes(&fn, kd::build_trees_kernel<false>);
    const size_t optin = (size_t)d->smem_optin;
    const size_t room = optin > fa.sharedSizeBytes ? optin - fa.sharedSizeBytes : 0;
    // The cap on dynamic shared memory, raised once to all the device allows (both kernels
    // hold the same static arrays).
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kd::build_trees_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)room);
    if (e == cudaSuccess)
      e = cudaFuncSetAttribute(kd::build_trees_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)room);
    if (e != cudaSuccess) return (int)e;
    f.room = room;
    f.smem_sm = (size_t)d->smem_sm;
    f.cta_fixed = fn.sharedSizeBytes + (size_t)d->smem_reserved;
    f.sms = d->sms;
    f.pdl = KD_BUILD_PDL && d->major == 9;
    f.ready = 1;
  }
  *out = &f;
  return 0;
}

// The kernel a batch takes (kd::takes_wide_kernel, tree_heuristics.cuh) on this device.
bool wide_kernel(const BuildFacts& f, int B, size_t smem) {
  return kd::takes_wide_kernel(B, f.sms, smem + f.cta_fixed, f.smem_sm);
}

// The shapes a build takes: the plan and the launch check them alike, before any device query.
bool build_shape_ok(int B, int L, int K, int D) {
  return B >= 0 && L >= 0 && K >= 0 && D >= 1 && D <= kd::MAX_SLOTS && L <= kd::MAX_DEPTH;
}

// kd_build_plan_make's work; `facts` (may be null) gets the device facts it read, so that a
// launch reads them once.
int make_plan(int B, int L, int K, int D, int visibility, kd_build_plan* plan, const BuildFacts** facts) {
  if (!plan || !build_shape_ok(B, L, K, D)) return KD_ERR_ARGUMENT;
  BuildFacts* f = nullptr;
  const int rc = build_facts(&f);
  if (rc != 0) return rc;
  // A limit set by kd_build_set_smem_limit stands in for a smaller GPU's shared memory.
  const size_t room = g_smem_limit > 0 && (size_t)g_smem_limit < f->room ? (size_t)g_smem_limit : f->room;
  // Budgets are clamped to D - 1, so no request reads ranks past min(K, D - 1).
  int lp_ld = K < D - 1 ? K : D - 1;
  const size_t key_bytes = (size_t)D * kd::KEY_WORDS * sizeof(uint64_t);
  int use_keys = L <= kd::KEY_DEPTH && key_bytes <= room;
  // The node buffer's size is ts_capacity's rule, which widens it from batch 16.
  int ts_cap = kd::ts_capacity(D - 1, B >= 16);
  size_t smem = kd::ts_smem_bytes(L, lp_ld, ts_cap);
  if (L > kd::KEY_DEPTH || smem > room) {
    // Warp loop only: path keys first (they make ties cheap), then the staged log-probs.
    // Staging buys a faster pop but costs residency: with more requests than SMs, keep
    // CTAs small so that every request of the batch runs at once.
    ts_cap = 0;
    const size_t smem_keys = use_keys ? key_bytes : 0;
    size_t lp_bytes = (size_t)L * lp_ld * sizeof(float);
    if (lp_bytes > kd::LP_SMEM_MAX || smem_keys + lp_bytes > room || B > f->sms) { lp_ld = 0; lp_bytes = 0; }
    smem = smem_keys + lp_bytes;
  }
  // Visibility from bit rows in shared memory (over the selection's buffers) where they fit.
  const size_t vis_bytes = (size_t)D * kd::ceil_div(D, 32) * sizeof(uint32_t);
  const int vis_smem = visibility && vis_bytes <= room;
  if (vis_smem && vis_bytes > smem) smem = vis_bytes;
  *plan = kd_build_plan{B, L, K, D, visibility ? 1 : 0, wide_kernel(*f, B, smem) ? 1 : 0, ts_cap, lp_ld,
                        use_keys, vis_smem, (int)smem};
  if (facts) *facts = f;
  return 0;
}
}  // namespace

extern "C" int kd_build_plan_make(int B, int L, int K, int D, int visibility, kd_build_plan* plan) {
  return make_plan(B, L, K, D, visibility, plan, nullptr);
}

extern "C" int kd_build_trees(const float* top_lp, const int64_t* top_ids, const int32_t* budgets,
                              const int32_t* prefix_lens, const int64_t* root_tokens, int B,
                              int L, int K, int D, int32_t* node_counts, int64_t* tokens,
                              int64_t* depths, int32_t* parents, int64_t* positions,
                              int64_t* next_token, int64_t* next_sibling, uint8_t* visibility,
                              int32_t* visibility_bits, int32_t* status, void* stream) {
  if (B == 0) return build_shape_ok(B, L, K, D) ? 0 : KD_ERR_ARGUMENT;  // no device query for an empty batch
  kd_build_plan p;
  const BuildFacts* f = nullptr;
  const int rc = make_plan(B, L, K, D, visibility || visibility_bits, &p, &f);
  if (rc != 0) return rc;
  const int threads = kd::BUILD_THREADS;  // 16 warps: the selection is latency-bound
  auto kernel = p.wide ? kd::build_trees_kernel<true> : kd::build_trees_kernel<false>;
  // On 9.x the build is a programmatic dependent of the kernel before it (the drafter's
  // top-k in a decode step): its launch hides behind that kernel's tail, and its CTAs wait
  // in pdl_wait() before reading anything. It triggers no dependent of its own.
  const cudaError_t e = kd::launch_kernel(
      kernel, dim3(B), dim3(threads), (size_t)p.smem_bytes, (cudaStream_t)stream, f->pdl, top_lp, top_ids, budgets,
      prefix_lens, root_tokens, L, K, D, node_counts, tokens, depths, parents, positions, next_token, next_sibling,
      visibility, visibility_bits, status, p.staged_ld, p.path_keys, p.node_buffer, p.vis_smem);
  if (e != cudaSuccess) return (int)e;
  KD_LAUNCH_CHECK();
  return 0;
}

// Caps the build's dynamic shared memory (0: the device's own limit), so that a large GPU
// runs the code paths of a smaller one (RTX PRO 6000: 99 KB a block); returns the old cap.
extern "C" int kd_build_set_smem_limit(int bytes) {
  const int old = g_smem_limit;
  g_smem_limit = bytes > 0 ? bytes : 0;
  return old;
}

#ifdef KD_BUILD_PROFILE
// Phase stamps of the chosen block in the last launch (profile builds only).
extern "C" int kd_build_profile(long long* out) {
  return (int)cudaMemcpyFromSymbol(out, kd::g_prof, sizeof(long long) * kd::KD_PROF_SLOTS);
}
// The block (request) whose phases later launches stamp; the stamps are cleared.
extern "C" int kd_build_profile_block(int b) {
  const long long zero[kd::KD_PROF_SLOTS] = {};
  const cudaError_t e = cudaMemcpyToSymbol(kd::g_prof, zero, sizeof(zero));
  return (int)(e != cudaSuccess ? e : cudaMemcpyToSymbol(kd::g_prof_block, &b, sizeof(int)));
}
// Cycles each of the first KD_PROF_BLOCKS requests took in the last launch (thread 0's
// clock from its start to its end): which request sets a batch's time.
extern "C" int kd_build_profile_blocks(long long* out) {
  return (int)cudaMemcpyFromSymbol(out, kd::g_block_cycles, sizeof(long long) * kd::KD_PROF_BLOCKS);
}
#endif

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

// The kernel's threshold selection, run on the host with one thread over one request:
// pops (parents, ranks, depths [n + 1]) and links (next_token, next_sibling [n + 1]).
// Returns n, -1 where the selection refused (the kernel then runs the warp loop), -2
// where the certificate does not hold (unsorted rows, L > 16) or an argument is bad.
// stats (may be null): {tau raises, candidates sorted, 1 where laid out one deviation wide}.
// linear_raise: 1 runs the one-CTA-an-SM kernel's program (batches up to the SM count: tau
// raised by linear bins first, deep trees laid out at once), 0 the two-CTA one's.
extern "C" int kd_select_threshold_host(const float* top_lp, int L, int K, int budget,
                                        int32_t* parents, int32_t* ranks, int32_t* depths,
                                        int32_t* next_tok, int32_t* next_sib, int32_t* stats,
                                        int linear_raise) {
  if (L < 0 || K < 0 || budget > 1024 || L > kd::KEY_DEPTH) return -2;
  const int keff = budget < K ? budget : K;
  const int ld = keff > 0 ? keff : 1, cap = kd::ts_capacity(budget, true);
  std::vector<unsigned char> buf(kd::ts_smem_bytes(L, ld, cap) + 16);
  const kd::Threshold t = kd::ts_views(buf.data(), L, ld, cap);
  for (int d = 0; d < L; ++d)
    for (int r = 0; r < keff; ++r) {
      const float v = top_lp[(size_t)d * K + r];
      const float c = v == -INFINITY ? kd::NEG_INF_FLOOR : v;
      const float prev = r == 0 ? 0.0f : t.lp[d * t.ld + r - 1];
      if (v != v || v == INFINITY || !(c <= prev)) return -2;
      t.lp[d * t.ld + r] = c;
    }
  const int D = (budget > 0 ? budget : 0) + 1;
  std::vector<uint32_t> nodes(D, kd::pack_node(0, 0, 0));
  std::vector<int16_t> links(3 * (size_t)D, -1);
  const kd::Selection sel{nullptr, nodes.data(), nullptr, links.data(), links.data() + D, links.data() + 2 * D};
  int st[3] = {0, 0, 0};
  const int n = linear_raise ? kd::threshold_select<true>(t, L, K, budget, sel, 0, 1, st, kd::START_ALWAYS)
                             : kd::threshold_select<false>(t, L, K, budget, sel, 0, 1, st, kd::START_ALWAYS);
  if (stats) { stats[0] = st[0]; stats[1] = st[1]; stats[2] = st[2]; }
  if (n < 0) return n;
  parents[0] = -1; ranks[0] = 0; depths[0] = 0;
  for (int i = 0; i <= n; ++i) {
    if (i > 0) {
      parents[i] = kd::node_parent(nodes[i]); ranks[i] = kd::node_rank(nodes[i]);
      depths[i] = kd::node_depth(nodes[i]);
    }
    next_tok[i] = links[i];
    next_sib[i] = links[D + i];
  }
  return n;
}
