// Bounds for tau: a first tau from the nodes one deviation off the first-child chain
// (deviation_bound) or from the chain's own children (chain_bound), and a raise's
// level_bound; each a lower bound of the budget-th best score, by pivot rounds.
#pragma once

#include "tree_rank.cuh"

namespace kd {

// A start for tau at least as high as `tau` (itself a lower bound of the budget-th best
// score) from the nodes with at most one deviation from the first-child chain: 0^a r 0^b
// (any a, b; r >= 1) and the chain 0^d itself. The budget-th best of any set of tree nodes
// is <= the tree's, so a threshold that this set reaches `budget` times is a lower bound.
// The chain's own 0^d r alone sat at 0.25-0.75 x the budget above the budget-th score
// where K < budget (docs/kernels/tree_build.md, session 21); one deviation anywhere comes
// far closer. Counting is approximate and then made safe: node 0^a r 0^b scores about
// chain(a) + lp[a][r] + (chain(a+b+1) - chain(a+1)) (chain(d): the heap's sum to 0^d), so
// for a pivot x each pair (a, b) is one binary search over row a for lp >= x - that sum,
// no adds inside. Every term is <= 0 and smaller in size than the node's score, so the
// approximation is within (3 L + 8) ulps of |x| of the heap's exact score: the pivot found
// is lowered by START_MARGIN |x| (2^-44, well above that for L <= 16) before it is used.
// Rounds of START_PIVOTS pivots narrow [tau, lp[0][0]] 17-fold each. Device: warp w counts
// pivot w (lanes over the (a, b) pairs, each lane's pairs in registers), one barrier a round.
constexpr int START_SLOTS = 5;  // pairs a lane holds: L (L + 1) / 2 <= 136 = 32 x 4.25
constexpr double START_MARGIN = 1.0 / 17592186044416.0;  // 2^-44

// Pivot k (1 .. pv.count) of [lo, hi], rounded the same wherever it is computed (no
// contraction): chain_bound returns exactly a pivot that was counted.
#ifdef __CUDA_ARCH__
__device__ inline double start_pivot(double lo, double hi, int k, const Pivots& pv) {
  double f = __dmul_rn((double)k, pv.step);
  if (pv.squared) f = __dmul_rn(f, f);
  return __dadd_rn(lo, __dmul_rn(__dsub_rn(hi, lo), f));
}
#else
inline double start_pivot(double lo, double hi, int k, const Pivots& pv) {
  double f = (double)k * pv.step;
  if (pv.squared) f = f * f;
  return lo + (hi - lo) * f;
}
#endif

// A round's step: [lo, hi] := between pivot best + 1, the highest whose count holds
// `budget` (-1: none did), and the next one (counts fall as pivots rise).
KD_HD void start_narrow(int best, double* lo, double* hi, const Pivots& pv) {
  const double nlo = best >= 0 ? start_pivot(*lo, *hi, best + 1, pv) : *lo;
  if (best + 1 < pv.count) *hi = start_pivot(*lo, *hi, best + 2, pv);
  *lo = nlo;
}

#ifdef __CUDA_ARCH__
// pv.rounds rounds of pv.count pivots over [lo, hi]: GROUP lanes (16 or 32) count each pivot
// (count(x, sub): the share of lane `sub` of the group, summed over it), one barrier a
// round; returns the last pivot that held `budget` (lo where none did). A count that needs
// at most 16 lanes takes half-warps: 16 pivots on half the warps, or 32 on all of them in
// about the same time (a round is latency, ~1.3k cycles). Round counts alternate between
// two scratch slots, so a round writes without a barrier after the last one's reads; each
// warp finds the step by one ballot, not a loop over the counts in every thread. Profile
// builds stamp slot `stamp` + round where stamp >= 0. Needs nthreads >= GROUP * pv.count
// (the callers check, before their setup).
template <int GROUP, class Count>
__device__ double pivot_rounds(const Threshold& t, double lo, double hi, int budget, const Pivots& pv, int stamp,
                               int tid, Count count) {
  static_assert(GROUP == 16 || GROUP == 32, "a pivot's lanes lie in one warp");
  const int lane = tid & 31, v = tid / GROUP, sub = tid & (GROUP - 1);
  for (int round = 0; round < pv.rounds && hi > lo; ++round) {
    int* cnt = t.scratch + (round & 1) * pv.count;
    if (v < pv.count) {  // whole warps
      int n = count(start_pivot(lo, hi, v + 1, pv), sub);
      for (int o = GROUP / 2; o > 0; o >>= 1) n += __shfl_xor_sync(FULL_MASK, n, o);
      if (sub == 0) cnt[v] = n;
    }
    if (stamp >= 0) KD_PROF(stamp + round);
    __syncthreads();
    const int mine = lane < pv.count ? lane : 0;
    const unsigned held = __ballot_sync(FULL_MASK, lane < pv.count && cnt[mine] >= budget);
    start_narrow(held ? 31 - __clz(held) : -1, &lo, &hi, pv);
  }
  return lo;
}
#endif

// Host twin: the same pivots, count(x) the whole count, one thread.
template <class Count>
inline double pivot_rounds_host(double lo, double hi, int budget, const Pivots& pv, Count count) {
  for (int round = 0; round < pv.rounds && hi > lo; ++round) {
    int best = -1;
    for (int v = 0; v < pv.count; ++v)
      if (count(start_pivot(lo, hi, v + 1, pv)) >= budget) best = v;
    start_narrow(best, &lo, &hi, pv);
  }
  return lo;
}

// Pair q of (a, b), by its deepest depth e = a + b: q = e (e + 1) / 2 + a (q < 136: the
// float square root of 8 q + 1 is exact where it is a whole number).
KD_HD void dev_pair(int q, int* a, int* b) {
  int e = (int)((sqrtf((float)(8 * q + 1)) - 1.0f) * 0.5f);
  if ((e + 1) * (e + 2) / 2 <= q) ++e;  // guard the rounding either way
  if (e * (e + 1) / 2 > q) --e;
  *a = q - e * (e + 1) / 2;
  *b = e - *a;
}

// The highest power of two <= n (1 where n < 2): a power-of-two search's first step.
KD_HD int pow2_at_most(int n) {
  int p = 1;
  while (2 * p <= n) p <<= 1;
  return p;
}

// How many r in [1, keff) of a sorted row have row[r] >= y (yf = float_at_or_above(y)):
// a branch-free search in power-of-two steps (top = pow2_at_most(keff - 1)),
// so that a lane's searches can be interleaved.
KD_HD int dev_count(const float* row, int keff, int top, float yf) {
  int count = 0;
  for (int step = top; step > 0; step >>= 1) {
    const int r = count + step;
    if (r < keff && row[r < keff ? r : keff - 1] >= yf) count = r;
  }
  return count;
}

// The bound from the last pivot that held: lowered by the margin, and never below tau.
KD_HD double start_safe(double lo, double tau) {
  const double x = lo - 2.0 * START_MARGIN * (lo < 0 ? -lo : lo);
  return x > tau ? x : tau;
}

#ifdef __CUDA_ARCH__
// chain(d), the heap's sum of the first d rows' first log-probs (node 0^d's score), for
// d = `d` (0 .. L; L <= KEY_DEPTH). The loads and conversions are issued first and
// unconditionally (a clamped row), so only the adds, in the heap's order, are dependent.
__device__ __forceinline__ double chain_sums(const Threshold& t, int L, int d) {
  float v[KEY_DEPTH];
#pragma unroll
  for (int k = 0; k < KEY_DEPTH; ++k) v[k] = t.lp[min(k, L - 1) * t.ld];
  double c = 0.0, acc = 0.0;
#pragma unroll
  for (int k = 0; k <= KEY_DEPTH; ++k) {
    if (k == d) c = acc;
    if (k < L) acc = KD_DADD(acc, (double)v[k < KEY_DEPTH ? k : 0]);
  }
  return c;
}

// chain(0 .. KEY_DEPTH) made once a CTA, by warp 0's first lanes, into the node buffer's
// scores 1 .. KEY_DEPTH + 1 (free until the enumeration, whose first writes there follow a
// barrier), then a barrier: in every thread, the 16 float-to-double conversions queue on
// the conversion pipe, which batches of more requests than SMs share (docs/kernels/
// tree_build.md, session 29). Every thread of the CTA calls it; read back with chain_at.
__device__ __forceinline__ void share_chain_sums(const Threshold& t, int L, int tid) {
  if (tid <= KEY_DEPTH) t.score[1 + tid] = chain_sums(t, L, tid);
  __syncthreads();
}
__device__ __forceinline__ double chain_at(const Threshold& t, int d) { return t.score[1 + d]; }

// The lean search over N sorted rows at once (the one-CTA kernel's bounds): at[k] is the
// 32-bit shared address (smem_addr) of rank 0 of a range whose ranks 1 .. n are searched, and
// moves 4 bytes for each rank r with value >= y(k) (dev_count's count). Shar's first step, at rank
// first = n + 1 - top (top = pow2_at_most(n)), leaves a power-of-two range, so no step reads
// past rank n and none tests a bound; the steps are unrolled from MAX_STEP under a uniform test
// (immediate offsets): the rounds are bound by issue, not latency.
template <int N, int MAX_STEP, class Y>
__device__ __forceinline__ void lean_search(uint32_t (&at)[N], int first, int top, Y y) {
  float yf[N];
#pragma unroll
  for (int k = 0; k < N; ++k) {
    yf[k] = y(k);
    at[k] += shared_f32(at[k] + 4 * first) >= yf[k] ? 4 * first : 0;
  }
#pragma unroll
  for (int step = MAX_STEP; step > 0; step >>= 1)
    if (step < top)
#pragma unroll
      for (int k = 0; k < N; ++k) at[k] += shared_f32(at[k] + 4 * step) >= yf[k] ? 4 * step : 0;
}

// LEAN: the lean row search (the one-CTA kernel: under the two-CTA kernel's 64 registers its
// addresses spilled).
template <bool LEAN>
__device__ double deviation_bound_device(const Threshold& t, int L, int keff, int budget, double tau, int tid,
                                         int nthreads) {
  if (nthreads < 32 * START_PIVOTS) return tau;  // a warp a pivot
  const int lane = tid & 31, np = L * (L + 1) / 2;
  const int top = pow2_at_most(keff - 1);
  // Lane d: chain(d), the heap's sum to node 0^d (chain(L) on lane L; L <= 16).
  share_chain_sums(t, L, tid);
  KD_PROF(34);
  const double c = chain_at(t, min(lane, KEY_DEPTH));
  // This lane's pairs: row a and the approximate sum around lp[a][r].
  int row_of[START_SLOTS];
  double around[START_SLOTS];
#pragma unroll
  for (int k = 0; k < START_SLOTS; ++k) {
    const int q = lane + 32 * k;
    int a = 0, b = 0;
    if (q < np) dev_pair(q, &a, &b);
    const double ca = __shfl_sync(FULL_MASK, c, a), c1 = __shfl_sync(FULL_MASK, c, a + 1);
    const double cb = __shfl_sync(FULL_MASK, c, a + b + 1);
    row_of[k] = q < np ? a : -1;
    around[k] = ca + (cb - c1);
  }
  KD_PROF(16);
  // The lean search (DEV_LEAN) over ranks 1 .. keff - 1 of each slot's row (keff <= 1024:
  // steps below 512); a pair-less slot (its sum -inf) searches row 0 for +inf and stays at 0.
  // The counts are dev_count's.
  const int first = keff - top;
  uint32_t row_at[START_SLOTS];
#pragma unroll
  for (int k = 0; k < START_SLOTS && LEAN; ++k) {
    row_at[k] = smem_addr(t.lp + (row_of[k] >= 0 ? row_of[k] : 0) * t.ld);
    if (row_of[k] < 0) around[k] = -INFINITY;
  }
  const double lo = pivot_rounds<32>(t, tau, (double)t.lp[0], budget, dev_pivots(budget, (int)gridDim.x), 17, tid,
                                     [&](double x, int lane) {
    int n = lane >= 1 && lane <= L && c >= x;  // the chain node 0^lane
    if constexpr (LEAN) {
      uint32_t at[START_SLOTS];
#pragma unroll
      for (int k = 0; k < START_SLOTS; ++k) at[k] = row_at[k];
      lean_search<START_SLOTS, 256>(at, first, top, [&](int k) { return float_at_or_above(x - around[k]); });
#pragma unroll
      for (int k = 0; k < START_SLOTS; ++k) n += (int)(at[k] - row_at[k]) >> 2;
      return n;
    } else {
      // dev_count over the lane's slots, steps outside: the slots' loads go out together.
      int count[START_SLOTS];
      float yf[START_SLOTS];
#pragma unroll
      for (int k = 0; k < START_SLOTS; ++k) { count[k] = 0; yf[k] = float_at_or_above(x - around[k]); }
      for (int step = top; step > 0; step >>= 1)
#pragma unroll
        for (int k = 0; k < START_SLOTS; ++k) {
          const int r = count[k] + step;
          if (row_of[k] >= 0 && r < keff && t.lp[row_of[k] * t.ld + (r < keff ? r : keff - 1)] >= yf[k]) count[k] = r;
        }
#pragma unroll
      for (int k = 0; k < START_SLOTS; ++k) n += count[k];
      return n;
    }
  });
  return start_safe(lo, tau);
}
#endif

// Host twin of chain_sums: cs[d] = chain(d) for d = 0 .. L (L <= KEY_DEPTH).
inline void chain_sums_host(const Threshold& t, int L, double* cs) {
  cs[0] = 0.0;
  for (int d = 0; d < L; ++d) cs[d + 1] = KD_DADD(cs[d], (double)t.lp[d * t.ld]);
}

// Host twin: the same sums, pivots and counts, one thread.
inline double deviation_bound_host(const Threshold& t, int L, int keff, int budget, double tau) {
  double cs[KEY_DEPTH + 1];
  chain_sums_host(t, L, cs);
  const int np = L * (L + 1) / 2;
  const int top = pow2_at_most(keff - 1);
  // The host build stands for a batch of requests past every gate (its node buffer is the
  // batched one too).
  const double lo = pivot_rounds_host(tau, (double)t.lp[0], budget, dev_pivots(budget, DEV_ONE_ROUND_MAX_BATCH + 1), [&](double x) {
    int n = 0;
    for (int d = 1; d <= L; ++d) n += cs[d] >= x;
    for (int q = 0; q < np; ++q) {
      int a, b;
      dev_pair(q, &a, &b);
      n += dev_count(t.lp + a * t.ld, keff, top, float_at_or_above(x - (cs[a] + (cs[a + b + 1] - cs[a + 1]))));
    }
    return n;
  });
  return start_safe(lo, tau);
}

#ifdef __CUDA_ARCH__
template <bool WIDE>
__device__ inline double deviation_bound(const Threshold& t, int L, int keff, int budget, double tau, int tid,
                                         int nthreads) {
  return deviation_bound_device<WIDE && DEV_LEAN>(t, L, keff, budget, tau, tid, nthreads);
}
#else
template <bool WIDE>
inline double deviation_bound(const Threshold& t, int L, int keff, int budget, double tau, int tid, int nthreads) {
  (void)tid; (void)nthreads;
  return deviation_bound_host(t, L, keff, budget, tau);
}
#endif



// The chain's sums shared for the one-deviation layout where no start bound shared them
// (the device layout reads them with chain_at; the host twin sums them itself).
#ifdef __CUDA_ARCH__
__device__ inline void share_chain_for_layout(const Threshold& t, int L, int tid) { share_chain_sums(t, L, tid); }
#else
inline void share_chain_for_layout(const Threshold&, int, int) {}
#endif

// The tree's depth at `tau`: the largest d <= L with chain(d) >= tau, since node 0^d is the
// best of depth d (rows non-increasing, rounding monotone), so the walk stops there instead
// of materialising an empty level. Warp 0 writes it to t.scratch[TS_DEPTH]; read after the
// walk's first barrier. `shared`: chain(0 .. L) is in the node buffer (a bound or the layout
// shared it); else a warp scan of the rows' first log-probs, whose adds run in another order
// than the heap's: a margin far above their rounding (<= 32 ulps of the sum, all terms <= 0)
// keeps the depth an upper bound (a level too many finds no child; one too few would lose
// nodes). Five shuffle steps instead of sixteen dependent adds. tau <= 0 = chain(0).
#ifdef __CUDA_ARCH__
__device__ inline void share_tree_depth(const Threshold& t, int L, double tau, bool shared, int tid) {
  if (tid < 32) {
    double c;
    if (shared) {
      c = chain_at(t, min(tid, L));
    } else {
      c = warp_inclusive_scan(tid >= 1 && tid <= L ? (double)t.lp[(tid - 1) * t.ld] : 0.0, tid);
      c *= 1.0 - 1e-12;  // c <= 0: raised by 1e-12 of itself
    }
    const unsigned reach = __ballot_sync(FULL_MASK, tid <= L && c >= tau);
    if (tid == 0) t.scratch[TS_DEPTH] = 31 - __clz(reach | 1u);
  }
}
#else
// Host twin: the same sums in the same order (the heap's where shared, else the warp scan's
// steps and margin), so the host fuzz checks that the margin keeps the depth an upper bound.
inline void share_tree_depth(const Threshold& t, int L, double tau, bool shared, int) {
  double c[32];
  if (shared) {
    chain_sums_host(t, L, c);
  } else {
    for (int i = 0; i < 32; ++i) c[i] = i >= 1 && i <= L ? (double)t.lp[(i - 1) * t.ld] : 0.0;
    for (int o = 1; o < 32; o <<= 1)
      for (int i = 31; i >= o; --i) c[i] = KD_DADD(c[i], c[i - o]);  // downward: c[i - o] not yet updated
    for (int i = 0; i <= L; ++i) c[i] *= 1.0 - 1e-12;
  }
  int depth = 0;
  for (int d = 1; d <= L; ++d)
    if (c[d] >= tau) depth = d;
  t.scratch[TS_DEPTH] = depth;
}
#endif

// Pivot rounds over the chain's own nodes 0^d r only (the heap's exact sums, one binary
// search per depth): ~4k cycles against deviation_bound's ~20k, and as good where K >=
// budget (no raises at the sweep's shapes), so it serves there; its pivots: chain_pivots.
#ifdef __CUDA_ARCH__
__device__ inline double chain_bound(const Threshold& t, int L, int keff, int budget, double tau, int tid,
                                     int nthreads) {
  const Pivots pv = chain_pivots(budget);
  if (nthreads < 16 * pv.count) return tau;  // a half-warp a pivot
  // Lanes d and 16 + d: chain(d), the parent of the chain's depth-d nodes (L <= 16).
  share_chain_sums(t, L, tid);
  const double c = chain_at(t, tid & 15);
  KD_PROF(16);
  const double lo = pivot_rounds<16>(t, tau, (double)t.lp[0], budget, pv, 17, tid, [&](double x, int d) {
    return d < L ? count_children(t.lp + d * t.ld, keff, c, x) : 0;
  });
  return lo > tau ? lo : tau;
}
#else
inline double chain_bound(const Threshold& t, int L, int keff, int budget, double tau, int tid, int nthreads) {
  (void)tid; (void)nthreads;
  const Pivots pv = chain_pivots(budget);
  double cs[KEY_DEPTH + 1];
  chain_sums_host(t, L, cs);
  const double lo = pivot_rounds_host(tau, (double)t.lp[0], budget, pv, [&](double x) {
    int n = 0;
    for (int d = 0; d < L; ++d) n += count_children(t.lp + d * t.ld, keff, cs[d], x);
    return n;
  });
  return lo > tau ? lo : tau;
}
#endif


// A raise where level d + 1 overflows (parents [lb, le) at level d): the highest pivot x
// of [tau, lp[0][0]] that the nodes of levels <= d ([1, le), all >= tau) and every child
// of the parents (counted by binary search, not stored) reach `budget` times. The
// materialised part of the overflowing level is a biased sample (the first parents'
// children, up to the buffer's end), and its budget-th best crept up one distinct score a
// raise on coarse rows (docs/kernels/tree_build.md, session 21); the full level's count
// lands within a raise or two. Exact sums, so the pivot is a lower bound as it stands.
// Where it runs: LEVEL_RAISE_MAX and LEVEL_RAISE_OVER (tree_heuristics.cuh).
// Device: each parent's searches stay within its count at tau, which materialise_level
// leaves in t.pos (most parents of an overflowing level have a few children, many none).
#ifdef __CUDA_ARCH__
__device__ double level_bound_device(const Threshold& t, const float* row, int keff, int budget, double tau,
                                     int lb, int le, int tid, int nthreads) {
  if (nthreads < 32 * START_PIVOTS) return tau;  // a warp a pivot
  const double lo = pivot_rounds<32>(t, tau, (double)t.lp[0], budget, even_pivots(budget), -1, tid,
                                     [&](double x, int lane) {
    int n = 0;
    for (int i = 1 + lane; i < le; i += 32) n += t.score[i] >= x;
    for (int p = lb + lane; p < le; p += 32) {
      const int c = t.pos[p - lb];  // children >= x > tau: a prefix of those >= tau
      if (c > 0) n += count_children(row, c, t.score[p], x);
    }
    return n;
  });
  __syncthreads();  // the counts are read before the caller's next writes to scratch
  return lo;
}
#endif

// Host twin: the same pivots and counts, one thread.
inline double level_bound_host(const Threshold& t, const float* row, int keff, int budget, double tau, int lb,
                               int le) {
  return pivot_rounds_host(tau, (double)t.lp[0], budget, even_pivots(budget), [&](double x) {
    int n = 0;
    for (int i = 1; i < le; ++i) n += t.score[i] >= x;
    for (int p = lb; p < le; ++p) n += count_children(row, keff, t.score[p], x);
    return n;
  });
}

#ifdef __CUDA_ARCH__
__device__ inline double level_bound(const Threshold& t, const float* row, int keff, int budget, double tau,
                                     int lb, int le, int tid, int nthreads) {
  return level_bound_device(t, row, keff, budget, tau, lb, le, tid, nthreads);
}
#else
inline double level_bound(const Threshold& t, const float* row, int keff, int budget, double tau, int lb, int le,
                          int tid, int nthreads) {
  (void)tid; (void)nthreads;
  return level_bound_host(t, row, keff, budget, tau, lb, le);
}
#endif

}  // namespace kd
