// Threshold selection: the parallel form of the best-first build (spec ddtree.md 2-3), run
// by a whole CTA per request. Python reference and argument: kdtree/reference/threshold_select.py;
// design and measurements: docs/kernels/tree_build.md.
//
// Certificate: every depth's first Keff log-probs (-inf clamped) are non-increasing and
// <= 0 (the caller checks this while staging them), and every selected node's score
// fl(parent + lp) is exact (TwoSum, checked here). Then scores never rise along the tree
// and the heap pops exactly the top-`budget` nodes in (score, rank path) order, so:
//  1. enumerate S(tau) = {score >= tau} level by level: a parent's children in S are a
//     rank prefix (one binary search per parent), laid out by a scan (warp 0 alone while
//     a level has at most 32 parents, then the block); a deep tree one deviation wide off
//     the first-child chain is laid out at once instead (one-CTA kernel);
//  2. a level that overflows the node buffer raises tau to about the budget-th best score
//     of what was materialised (linear score bins or radix passes over the score bits; the
//     budget-th best of any subset of the tree is <= the tree's own), drops what fell
//     below, and is redone;
//  3. path keys (a walk up each node, or from a laid-out node's deviation), a sort by
//     (score, key) (device: ranks by counting up to RANK_COUNT_MAX candidates, by counting
//     within linear score bins above, merged warp-sorted runs where a bin is too tied;
//     host: a bitonic network), keep `budget`.
// A refusal returns -1 and the caller runs the heap-exact warp loop (tree_select.cuh).
// Every function is called by all threads of the block with uniform control flow around
// barriers; the host build runs the same code with one thread (barriers are no-ops). Where
// the two differ, a device function and its host twin of the same name (or a dispatcher to
// `_device` and `_host` twins); the device's own schedules (warp 0's narrow levels, the
// counting ranks) have host twins that do nothing, so the host takes the general path.
#pragma once
#include <string.h>

#include "tree_select.cuh"

namespace kd {

#ifdef __CUDA_ARCH__
#define KD_BARRIER() __syncthreads()
#else
#define KD_BARRIER() ((void)0)
#endif

// Profile builds (-DKD_BUILD_PROFILE): one block (g_prof_block, 0 unless chosen) stamps
// clock64() at phase ends.
#ifdef KD_BUILD_PROFILE
constexpr int KD_PROF_SLOTS = 33;  // scripts/profile_tree_build.py reads as many
__device__ long long g_prof[KD_PROF_SLOTS];
__constant__ int g_prof_block;  // constant: the stamps' test costs no global load
constexpr int KD_PROF_BLOCKS = 256;
__device__ long long g_block_cycles[KD_PROF_BLOCKS];  // per request: tree_build.cu
#endif
#if defined(KD_BUILD_PROFILE) && defined(__CUDA_ARCH__)
#define KD_PROF(k) do { if (threadIdx.x == 0 && blockIdx.x == g_prof_block) g_prof[k] = clock64(); } while (0)
#else
#define KD_PROF(k) ((void)0)
#endif

constexpr int TS_MAX_NODES = 4096;   // node buffer; parent index in 12 bits
constexpr int TS_MIN_NODES = 64;
constexpr int TS_MAX_RAISES = 16;    // then refuse: ties that no threshold separates
constexpr int TS_BINS = 256;         // radix digit of 8 bits
constexpr int TS_COUNTERS = TS_BINS + 16;  // three rotating level counters
constexpr int TS_NARROW = TS_COUNTERS + 8;  // where warp 0's narrow levels ended (3 ints)
constexpr int TS_SCRATCH_INTS = TS_BINS + 48;

// Node of the enumerated set: parent's buffer index, rank, depth and an inexact-sum flag.
KD_HD uint32_t ts_meta(int parent, int rank, int depth, bool inexact) {
  return (uint32_t)parent | ((uint32_t)rank << 12) | ((uint32_t)depth << 22) | ((uint32_t)inexact << 31);
}
KD_HD int ts_parent(uint32_t m) { return (int)(m & 0xfffu); }
KD_HD int ts_rank(uint32_t m) { return (int)((m >> 12) & 0x3ffu); }
KD_HD int ts_depth(uint32_t m) { return (int)((m >> 22) & 0x1ffu); }
KD_HD bool ts_inexact(uint32_t m) { return (m >> 31) != 0; }

struct SortItem {
  double score;
  uint64_t k0;  // first word of the path key: most ties are settled in registers
  int idx;
  int pad;
};

// Shared-memory views of one request's selection (sizes: kd_threshold_smem_bytes).
struct Threshold {
  float* lp;          // [L][ld] staged log-probs, -inf clamped; dead after enumeration
  uint64_t* keys;     // [cap][KEY_WORDS] path keys, written over lp after enumeration
  double* score;      // [cap]
  uint32_t* meta;     // [cap]
  int* pos;           // [cap + 1] child offsets, compaction targets, then pop indices
  SortItem* items;    // [cap] compaction staging, then the sort
  int* scratch;       // [TS_SCRATCH_INTS] radix histogram and broadcast slots
  unsigned long long* minkey;  // two 64-bit slots: raise_tau's minimum, raise_tau_linear's bin range
  int ld;             // row stride of lp
  int cap;            // node buffer size
};

// Row stride of the staged log-probs for `ld` ranks: odd, so that the rows' same rank falls
// in different shared-memory banks (deviation_bound reads one rank of many rows at once; a
// stride of 256 put them all in one bank).
KD_HD int ts_stride(int ld) { return ld | 1; }

KD_HD size_t ts_smem_bytes(int L, int ld, int cap) {
  const size_t lp = (size_t)L * ts_stride(ld) * sizeof(float), keys = (size_t)cap * KEY_WORDS * 8;
  const size_t a = ((lp > keys ? lp : keys) + 15) & ~(size_t)15;
  return a + (size_t)cap * (sizeof(SortItem) + 8 + 4) + (size_t)(cap + 1) * 4 + TS_SCRATCH_INTS * 4 + 16;
}

// Carve the views out of one 16-byte aligned block.
KD_HD Threshold ts_views(unsigned char* base, int L, int ld, int cap) {
  Threshold t;
  const size_t lp = (size_t)L * ts_stride(ld) * sizeof(float), keys = (size_t)cap * KEY_WORDS * 8;
  const size_t a = ((lp > keys ? lp : keys) + 15) & ~(size_t)15;
  t.lp = reinterpret_cast<float*>(base);
  t.keys = reinterpret_cast<uint64_t*>(base);
  t.items = reinterpret_cast<SortItem*>(base + a);
  const size_t sc = a + (size_t)cap * sizeof(SortItem);
  t.score = reinterpret_cast<double*>(base + sc);
  t.minkey = reinterpret_cast<unsigned long long*>(base + sc + (size_t)cap * 8);
  t.meta = reinterpret_cast<uint32_t*>(base + sc + (size_t)cap * 8 + 16);
  t.pos = reinterpret_cast<int*>(base + sc + (size_t)cap * 12 + 16);
  t.scratch = t.pos + cap + 1;
  t.ld = ts_stride(ld);
  t.cap = cap;
  return t;
}

// For s = fl(a + b): true where the sum is exact (a + b == s). Of s - a and s - b, the one
// that subtracts the larger operand is exact (Fast2Sum), so both give back the other operand
// only then. Two independent subtractions, not TwoSum's four dependent ones: it runs on warp
// 0's narrow chain.
KD_HD bool exact_sum(double a, double b, double s) {
  return KD_DSUB(s, a) == b && KD_DSUB(s, b) == a;
}

// The least float >= y: for a float v, v >= y exactly when v >= it.
#ifdef __CUDA_ARCH__
__device__ inline float float_at_or_above(double y) {
  return __double2float_ru(y);
}
#else
inline float float_at_or_above(double y) {
  float f = (float)y;
  if ((double)f < y) f = nextafterf(f, INFINITY);
  return f;
}
#endif

// a - b rounded up: at least the exact difference.
#ifdef __CUDA_ARCH__
__device__ inline double dsub_up(double a, double b) {
  return __dsub_ru(a, b);
}
#else
inline double dsub_up(double a, double b) {
  return nextafter(a - b, INFINITY);  // past the nearest: one ulp of slack, still an upper bound
}
#endif

// v >= y as IEEE floats (fast-math's flush-to-zero would count a subnormal y as 0).
#ifdef __CUDA_ARCH__
__device__ inline bool float_ge(float v, float y) {
  unsigned r;
  asm("{\n\t.reg .pred p;\n\tsetp.ge.f32 p, %1, %2;\n\tselp.u32 %0, 1, 0, p;\n\t}" : "=r"(r) : "f"(v), "f"(y));
  return r != 0;
}
#else
inline bool float_ge(float v, float y) {
  return v >= y;
}
#endif

// The end of the prefix of ranks r in [first, keff) with fl(s + lp[r]) >= tau. Not inlined:
// count_children's rare path, kept off its callers' registers.
__host__ __device__ __noinline__ static int count_exact(const float* row, int first, int keff, double s, double tau) {
  int len = keff - first;
  while (len > 0) {
    const int half = len >> 1;
    if (KD_DADD(s, (double)row[first + half]) >= tau) { first += half + 1; len -= half + 1; }
    else len = half;
  }
  return first;
}

// Children of a node of score s among ranks [0, keff) of a sorted row: fl(s + lp[r]) is
// non-increasing in r, so those >= tau are a prefix. Its length by a float search for
// lp >= yf, the least float >= tau - s rounded up (then s + lp >= tau exactly, and the
// heap's rounded sum too), without a conversion and a double add a step; sums that round
// up onto tau are missed by it, so the next rank is checked exactly, and where it holds,
// an exact search goes on past it.
KD_HD int count_children(const float* row, int keff, double s, double tau) {
  if (s < tau) return 0;
  const float yf = float_at_or_above(dsub_up(tau, s));
  int first = 0, len = keff;
  while (len > 0) {
    const int half = len >> 1;
    if (float_ge(row[first + half], yf)) { first += half + 1; len -= half + 1; }
    else len = half;
  }
  return first < keff && KD_DADD(s, (double)row[first]) >= tau ? count_exact(row, first + 1, keff, s, tau) : first;
}

// A double's bits and back.
#ifdef __CUDA_ARCH__
__device__ inline unsigned long long double_bits(double x) { return (unsigned long long)__double_as_longlong(x); }
__device__ inline double bits_double(unsigned long long u) { return __longlong_as_double((long long)u); }
#else
inline unsigned long long double_bits(double x) {
  unsigned long long u;
  memcpy(&u, &x, 8);
  return u;
}
inline double bits_double(unsigned long long u) {
  double x;
  memcpy(&x, &u, 8);
  return x;
}
#endif

// Scores as unsigned keys in the same order (all scores here are finite).
KD_HD unsigned long long order_key(double x) {
  const unsigned long long u = double_bits(x);
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}
KD_HD double from_order_key(unsigned long long u) {
  return bits_double((u >> 63) ? (u & 0x7fffffffffffffffull) : ~u);
}

// The bin of a score s >= lo among nb linear bins over [lo, lo + nb / scale]: monotone in s
// (each rounding step is), so a higher bin holds only higher scores.
KD_HD int score_bin(double s, double lo, double scale, int nb) {
  const double v = (s - lo) * scale;
  return v >= (double)(nb - 1) ? nb - 1 : (int)v;
}

// Shared-memory updates: atomics on the device, plain on the host twin's one thread.
#ifdef __CUDA_ARCH__
__device__ inline int smem_add(int* p, int v) { return atomicAdd(p, v); }
__device__ inline void smem_min(unsigned long long* p, unsigned long long v) { atomicMin(p, v); }
__device__ inline void smem_max(unsigned long long* p, unsigned long long v) { atomicMax(p, v); }
#else
inline int smem_add(int* p, int v) {
  const int old = *p;
  *p += v;
  return old;
}
inline void smem_min(unsigned long long* p, unsigned long long v) { if (v < *p) *p = v; }
inline void smem_max(unsigned long long* p, unsigned long long v) { if (v > *p) *p = v; }
#endif

#ifdef __CUDA_ARCH__
// A warp's inclusive scan of c over its lanes in order.
__device__ __forceinline__ int warp_inclusive_scan(int c, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(FULL_MASK, c, o);
    if (lane >= o) c += y;
  }
  return c;
}
#endif

// In-place exclusive scan of v[0, n); every thread gets the total. Each thread sums a
// contiguous chunk, warps scan the chunk sums, warp 0 scans the warp sums.
#ifdef __CUDA_ARCH__
__device__ inline int block_exclusive_scan(int* v, int n, int* sums, int tid, int nthreads) {
  const int per = (n + nthreads - 1) / nthreads;
  const int lo = min(n, tid * per), hi = min(n, lo + per);
  int sum = 0;
  for (int i = lo; i < hi; ++i) sum += v[i];
  const int lane = tid & 31, warp = tid >> 5, nw = nthreads >> 5;
  const int incl = warp_inclusive_scan(sum, lane);
  if (lane == 31) sums[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    const int w = lane < nw ? sums[lane] : 0;
    const int wi = warp_inclusive_scan(w, lane);
    if (lane < nw) sums[lane] = wi - w;
    if (lane == 31) sums[32] = wi;
  }
  __syncthreads();
  int run = sums[warp] + incl - sum;
  for (int i = lo; i < hi; ++i) { const int x = v[i]; v[i] = run; run += x; }
  const int total = sums[32];
  __syncthreads();
  return total;
}
#else
inline int block_exclusive_scan(int* v, int n, int* sums, int tid, int nthreads) {
  (void)sums; (void)tid; (void)nthreads;
  int run = 0;
  for (int i = 0; i < n; ++i) { const int x = v[i]; v[i] = run; run += x; }
  return run;
}
#endif

// Radix step: the highest bin b with count(bins > b) < need <= count(bins >= b). Written to
// out[0] = b, out[1] = count(bins > b). Device: warp 0 (lane l owns bins 8l .. 8l+7).
#ifdef __CUDA_ARCH__
__device__ inline void radix_pick(const int* hist, int need, int* out, int tid) {
  if (tid >= 32) return;
  const int lane = tid;
  int mine = 0;
  for (int i = 0; i < 8; ++i) mine += hist[lane * 8 + i];
  int suffix = mine;  // sum over lanes >= lane
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_down_sync(FULL_MASK, suffix, o);
    if (lane + o < 32) suffix += y;
  }
  const unsigned hit = __ballot_sync(FULL_MASK, suffix >= need);
  const int l = 31 - __clz(hit);  // need <= the total, so some lane hits
  if (lane == l) {
    int above = suffix - mine;
    for (int b = lane * 8 + 7; b >= lane * 8; --b) {
      if (above + hist[b] >= need) { out[0] = b; out[1] = above; break; }
      above += hist[b];
    }
  }
}
#else
inline void radix_pick(const int* hist, int need, int* out, int tid) {
  (void)tid;
  int above = 0;
  for (int b = TS_BINS - 1; b >= 0; --b) {
    if (above + hist[b] >= need) { out[0] = b; out[1] = above; return; }
    above += hist[b];
  }
}
#endif

// One count into hist[bin] where `in`, by every thread of a pass over the nodes. Scores crowd
// into a few bins, so on the device one atomic per distinct bin of the warp, not per lane.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ void count_in_bin(int* hist, bool in, int bin) {
  const unsigned active = __activemask();
  const unsigned peers = __match_any_sync(active, in ? bin : -1);
  if (in && (threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
}
#else
inline void count_in_bin(int* hist, bool in, int bin) {
  if (in) smem_add(&hist[bin], 1);
}
#endif

// A threshold whose count among nodes [1, m) is >= budget and at most budget + slack (where
// the bits allow): about the budget-th best score, an actual score of the set.
KD_HD double raise_tau(const Threshold& t, int m, int budget, int slack, int tid, int nthreads) {
  int* hist = t.scratch;
  int* pick = t.scratch + TS_BINS;
  unsigned long long prefix = 0;
  int need = budget, shift = 64;
  while (shift > 0) {
    shift -= 8;
    for (int i = tid; i < TS_BINS; i += nthreads) hist[i] = 0;
    KD_BARRIER();
    for (int i = 1 + tid; i < m; i += nthreads) {
      const unsigned long long u = order_key(t.score[i]);
      const bool in = shift == 56 || (u >> (shift + 8)) == (prefix >> (shift + 8));
      const int bin = (int)((u >> shift) & 0xff);
      count_in_bin(hist, in, bin);
    }
    KD_BARRIER();
    radix_pick(hist, need, pick, tid);
    KD_BARRIER();
    const int bin = pick[0], above = pick[1], in_bin = hist[bin];
    prefix |= (unsigned long long)bin << shift;
    need -= above;
    KD_BARRIER();  // hist and pick are rewritten next pass
    if (in_bin - need <= slack) break;
  }
  if (tid == 0) *t.minkey = ~0ull;
  KD_BARRIER();
  for (int i = 1 + tid; i < m; i += nthreads) {
    const unsigned long long u = order_key(t.score[i]);
    if ((u >> shift) == (prefix >> shift)) smem_min(t.minkey, u);
  }
  KD_BARRIER();
  const double tau = from_order_key(*t.minkey);
  KD_BARRIER();
  return tau;
}

// raise_tau's pick by TS_BINS linear bins over the scores' range [lo, score[1]] (all nodes
// [1, m) score >= lo), then over the picked bin's own range: scores spread over the range,
// so one or two passes meet the slack where the 64-bit radix takes four to eight. Exact
// ties end it too (a bin of one score); else after MAX passes the radix pick runs. Only the
// one-CTA-an-SM kernel takes it: under the two-CTA kernel's 64 registers it spills.
KD_HD int linear_bin(double s, double lo, double scale) {
  const double v = (s - lo) * scale;
  return v <= 0.0 ? 0 : v >= (double)(TS_BINS - 1) ? TS_BINS - 1 : (int)v;
}
KD_HD double raise_tau_linear(const Threshold& t, int m, int budget, int slack, double lo, int tid, int nthreads) {
  constexpr int MAX_PASSES = 3;
  int* hist = t.scratch;
  int* pick = t.scratch + TS_BINS;
  unsigned long long* range = t.minkey;  // two slots: the picked bin's lowest and highest key
  unsigned long long klo = 0, khi = ~0ull;
  double blo = lo, bhi = t.score[1];
  int need = budget;
  for (int pass = 0; pass < MAX_PASSES; ++pass) {
    const double scale = bhi > blo ? (double)TS_BINS / (bhi - blo) : 0.0;
    for (int i = tid; i < TS_BINS; i += nthreads) hist[i] = 0;
    if (tid == 0) { range[0] = ~0ull; range[1] = 0; }
    KD_BARRIER();
    for (int i = 1 + tid; i < m; i += nthreads) {
      const unsigned long long u = order_key(t.score[i]);
      const bool in = u >= klo && u <= khi;
      const int bin = linear_bin(t.score[i], blo, scale);
      count_in_bin(hist, in, bin);
    }
    KD_BARRIER();
    radix_pick(hist, need, pick, tid);
    KD_BARRIER();
    const int bin = pick[0], above = pick[1], in_bin = hist[bin];
    need -= above;
    for (int i = 1 + tid; i < m; i += nthreads) {
      const unsigned long long u = order_key(t.score[i]);
      if (u >= klo && u <= khi && linear_bin(t.score[i], blo, scale) == bin) {
        smem_min(&range[0], u);
        smem_max(&range[1], u);
      }
    }
    KD_BARRIER();
    klo = range[0];
    khi = range[1];
    KD_BARRIER();  // hist, pick and range are rewritten next pass
    if (in_bin - need <= slack || klo == khi) return from_order_key(klo);
    blo = from_order_key(klo);
    bhi = from_order_key(khi);
  }
  return raise_tau(t, m, budget, slack, tid, nthreads);
}

// Keep nodes [0, end) scoring >= tau, in order, parents remapped; returns how many.
// *lb (a level start inside [0, end)) becomes its new index.
KD_HD int compact(const Threshold& t, int end, double tau, int* lb, int tid, int nthreads) {
  for (int i = tid; i < end; i += nthreads) t.pos[i] = t.score[i] >= tau;
  KD_BARRIER();
  const int kept = block_exclusive_scan(t.pos, end, t.scratch, tid, nthreads);
  for (int i = tid; i < end; i += nthreads) {
    if (t.score[i] >= tau) {
      const uint32_t m = t.meta[i];
      const int p = i == 0 ? 0 : t.pos[ts_parent(m)];
      t.items[t.pos[i]] = SortItem{t.score[i], 0, (int)ts_meta(p, ts_rank(m), ts_depth(m), ts_inexact(m)), 0};
    }
  }
  const int new_lb = *lb < end ? t.pos[*lb] : kept;
  KD_BARRIER();
  for (int j = tid; j < kept; j += nthreads) {
    t.score[j] = t.items[j].score;
    t.meta[j] = (uint32_t)t.items[j].idx;
  }
  KD_BARRIER();
  *lb = new_lb;
  return kept;
}

// Child r of parent p (at level d), scored sc = sp + x, into slot `at`: its score, the FP64
// sum the spec fixes, and its meta (the sum's exactness decides whether ties need the exact
// path).
KD_HD void store_child(const Threshold& t, int d, int p, int r, int at, double sp, double x, double sc) {
  t.score[at] = sc;
  t.meta[at] = ts_meta(p, r, d + 1, !exact_sum(sp, x, sc));
}

// The root, node 0 of every enumeration: score 0, no parent.
KD_HD void store_root(const Threshold& t) {
  t.score[0] = 0.0;
  t.meta[0] = ts_meta(0, 0, 0, false);
}

KD_HD void write_child(const Threshold& t, const float* row, int d, int p, int r, int at) {
  const double sp = t.score[p], x = (double)row[r];
  store_child(t, d, p, r, at, sp, x, KD_DADD(sp, x));
}

#ifdef __CUDA_ARCH__
// The lane whose children hold the warp's child j (incl: the inclusive scan of the lanes'
// child counts): how many lanes' children end at or before j. All lanes call it.
__device__ __forceinline__ int owner_lane(int incl, int j) {
  int o = 0;
  for (int step = 16; step > 0; step >>= 1)
    if (__shfl_sync(FULL_MASK, incl, o + step - 1) <= j) o += step;
  return min(o, 31);
}
#endif

// Thread 0 zeroes all three rotating level counters; a barrier must come before any level
// reads them (each caller's next narrow_levels or block level has one).
KD_HD void clear_level_counters(const Threshold& t, int tid) {
  if (tid == 0)
    for (int c = 0; c < 3; ++c) t.scratch[TS_COUNTERS + c] = 0;
}

// Children of the level's parents [lb, le) scoring >= tau, appended at le: sibling ranks
// contiguous, ascending. Writes stop at the buffer's end; returns the level's full count
// (more than cap - le: the level overflowed). Device: each warp takes 32 parents and
// allocates its children with one atomic on the level's counter (t.scratch[TS_COUNTERS +
// d % 3], zero on entry); the order of parent groups varies, and nothing depends on it.
// Host: one block scan, parents in order.
#ifdef __CUDA_ARCH__
__device__ inline int materialise_level(const Threshold& t, const float* row, int keff, int d, double tau,
                                        int lb, int le, int tid, int nthreads) {
  const int room = t.cap - le;
  int* counter = t.scratch + TS_COUNTERS + d % 3;
  const int lane = tid & 31;
  for (int p0 = lb; p0 < le; p0 += nthreads) {
    const int p = p0 + tid;
    const int c = p < le ? count_children(row, keff, t.score[p], tau) : 0;
    if (p < le) t.pos[p - lb] = c;  // an overflow's level_bound searches within these counts
    const int incl = warp_inclusive_scan(c, lane);
    const int wtot = __shfl_sync(FULL_MASK, incl, 31);
    if (wtot == 0) continue;
    int base = lane == 31 ? atomicAdd(counter, wtot) : 0;
    base = __shfl_sync(FULL_MASK, base, 31);
    // Only children that fit are laid out: an overflowing level's full count may be
    // thousands (64 parents x 64 ranks), all of whose writes would be dropped.
    for (int j0 = 0; j0 < wtot && base + j0 < room; j0 += 32) {
      const int j = j0 + lane, o = owner_lane(incl, j);
      const int po = __shfl_sync(FULL_MASK, p, o), first = __shfl_sync(FULL_MASK, incl - c, o);
      const int at = base + j;
      if (j < wtot && at < room) write_child(t, row, d, po, j - first, le + at);
    }
  }
  __syncthreads();
  return *counter;
}
#else
inline int materialise_level(const Threshold& t, const float* row, int keff, int d, double tau,
                             int lb, int le, int tid, int nthreads) {
  const int room = t.cap - le;
  const int np = le - lb;
  for (int i = tid; i < np; i += nthreads) t.pos[i] = count_children(row, keff, t.score[lb + i], tau);
  const int total = block_exclusive_scan(t.pos, np, t.scratch, tid, nthreads);
  const int w = total < room ? total : room;
  for (int j = tid; j < w; j += nthreads) {
    int first = 0, len = np;  // owner: the last parent whose offset is <= j
    while (len > 0) {
      const int half = len >> 1;
      if (t.pos[first + half] <= j) { first += half + 1; len -= half + 1; }
      else len = half;
    }
    const int o = first - 1;
    write_child(t, row, d, lb + o, j - t.pos[o], le + j);
  }
  return total;
}
#endif

#ifdef __CUDA_ARCH__
constexpr int NARROW_BALLOT_STEPS = 4;  // ballot steps (small rows, grouped ranks) or parents (wider) a narrow level may take
#ifndef KD_NARROW_LEAD_MAX
#define KD_NARROW_LEAD_MAX 2
#endif
constexpr int NARROW_LEAD_MAX = KD_NARROW_LEAD_MAX;  // parents of 16 children or more a grouped narrow level takes first (lead parents)

// One ballot step of a narrow level: the lanes whose child (parent p, rank r, score sc =
// sp + x) is in take the next slots after `total` in lane order (parents in order, ranks
// ascending, as the block version lays them out). Returns the step's ballot.
__device__ __forceinline__ unsigned ballot_children(const Threshold& t, int d, bool in, int p, int r, double sp,
                                                    double x, double sc, int le, int room, int& total) {
  const unsigned mask = __ballot_sync(FULL_MASK, in);
  const int at = total + __popc(mask & ((1u << (threadIdx.x & 31)) - 1u));
  if (in && at < room) store_child(t, d, p, r, le + at, sp, x, sc);
  total += __popc(mask);
  return mask;
}

// One parent's children on a narrow level of rows wider than 32: 32 ranks a ballot step, on
// until a step's ballot is not full (the children are a rank prefix). x0 is rank `lane`'s
// log-prob, read once for the level.
__device__ __forceinline__ void ballot_parent(const Threshold& t, const float* row, int keff, int d, double tau,
                                              int p, double sp, double x0, int le, int room, int& total) {
  const int lane = threadIdx.x & 31;
  for (int r0 = 0; r0 < keff; r0 += 32) {
    const int r = r0 + lane;
    const double x = r0 == 0 ? x0 : (r < keff ? (double)row[r] : 0.0);
    const double sc = KD_DADD(sp, x);
    if (ballot_children(t, d, r < keff && sc >= tau, p, r, sp, x, sc, le, room, total) != FULL_MASK) break;
  }
}

// materialise_level for a level of at most 32 parents, by one warp: the children of
// parents [lb, le) scoring >= tau at le, in the layout the block version writes (each
// parent's children contiguous, ranks ascending), without its atomic and barrier.
// WIDE: the one-CTA-an-SM kernel's program (threshold_select).
template <bool WIDE>
__device__ int materialise_narrow(const Threshold& t, const float* row, int keff, int d, double tau,
                                  int lb, int le, int lane) {
  const int room = t.cap - le;
  if (keff <= 32) {
    // Small rows: a lane a (parent, rank) pair, G lanes a parent (G = keff rounded up to
    // a power of two). A parent's children in S are a rank prefix, so one ballot a step
    // lays the level out (parents in order, ranks ascending) without the binary search,
    // scan and owner search below (~5 dependent steps each).
    // Shifts, not divisions: this runs once a level on warp 0's dependent path.
    const int lg = 32 - __clz(max(keff, 1) - 1), G = 1 << lg, per = 32 >> lg;
    if (le - lb <= NARROW_BALLOT_STEPS * per) {
      const int j = lane >> lg, r = lane & (G - 1);
      int total = 0;
      for (int p0 = lb; p0 < le; p0 += per) {
        const int p = p0 + j;
        double sp = 0.0, x = 0.0, sc = 0.0;
        bool in = false;
        if (p < le && r < keff) {
          sp = t.score[p];
          x = (double)row[r];
          sc = KD_DADD(sp, x);
          in = sc >= tau;
        }
        ballot_children(t, d, in, p, r, sp, x, sc, le, room, total);
      }
      __syncwarp();
      return total;
    }
  } else if (le - lb <= NARROW_BALLOT_STEPS) {
    // Wider rows, a few parents: a parent at a time (ballot_parent). A level of one to four
    // parents takes a step or two each, not the search, scan and owner search below. The
    // first 32 ranks and the parents' scores are read once for the whole level.
    const double x0 = (double)row[lane];  // keff > 32: rank `lane` exists
    const double sv = lb + lane < le ? t.score[lb + lane] : 0.0;
    int total = 0;
    // Two to four parents whose children all lie in their first G ranks (G 4 or 8; 16 for two
    // parents): one ballot step for the level, lanes (parent, rank) as the grouped path lays
    // them out, instead of a step a parent (a confident drafter's chain-like levels). Three
    // votes decide G, as there. The one-CTA kernel only: the two-CTA one was not measured.
    if (WIDE && le - lb >= 2) {
      const int np = le - lb;
      const bool pl = lane < np;
      // The shuffles outside the votes' &&: every lane must reach each one.
      const double x3 = __shfl_sync(FULL_MASK, x0, 3), x7 = __shfl_sync(FULL_MASK, x0, 7);
      const double x15 = __shfl_sync(FULL_MASK, x0, 15);
      const unsigned r3 = __ballot_sync(FULL_MASK, pl && KD_DADD(sv, x3) >= tau);
      const unsigned r7 = __ballot_sync(FULL_MASK, pl && KD_DADD(sv, x7) >= tau);
      const unsigned r15 = __ballot_sync(FULL_MASK, pl && KD_DADD(sv, x15) >= tau);
      const int lg = r3 == 0u ? 2 : r7 == 0u ? 3 : r15 == 0u && np <= 2 ? 4 : 0;
      if (lg > 0) {
        const int j = lane >> lg, r = lane & ((1 << lg) - 1);
        const double sp = __shfl_sync(FULL_MASK, sv, j), x = __shfl_sync(FULL_MASK, x0, r);
        const double sc = KD_DADD(sp, x);
        ballot_children(t, d, j < np && sc >= tau, lb + j, r, sp, x, sc, le, room, total);
        __syncwarp();
        return total;
      }
    }
    for (int p = lb; p < le; ++p)
      ballot_parent(t, row, keff, d, tau, p, __shfl_sync(FULL_MASK, sv, p - lb), x0, le, room, total);
    __syncwarp();
    return total;
  } else {
    // Wider rows, five to 32 parents (a confident drafter's middle levels: most parents have
    // a child or two): where no parent's child of rank G - 1 reaches tau, every parent's
    // children lie in its first G ranks, and 32 / G parents go a ballot as for small rows.
    // G is the least of 4, 8, 16 that holds them all (one vote each).
    const int p = lb + lane;
    const double sv = p < le ? t.score[p] : 0.0;
    int lg = 0;
    unsigned reach[3] = {0u, 0u, 0u};  // parents whose child of rank 3, 7, 15 reaches tau
#pragma unroll
    for (int g = 2; g <= 4; ++g)
      if (lg == 0) {
        reach[g - 2] = __ballot_sync(FULL_MASK, p < le && KD_DADD(sv, (double)row[(1 << g) - 1]) >= tau);
        if (reach[g - 2] == 0u) lg = g;
      }
    // Where only a few parents have 16 children or more (the drafter sure of one token: its
    // rank-0 node has dozens), those lead parents go first, a parent at a time, and the
    // others by groups: a few ballot steps instead of the count, scan and owner search below.
    // The one-CTA-an-SM kernel only: the two-CTA kernel's 64 registers would spill more for it.
    unsigned lead = 0u;
    if (WIDE && lg == 0 && __popc(reach[2]) <= NARROW_LEAD_MAX) {
      lead = reach[2];
      lg = (reach[0] & ~lead) == 0u ? 2 : (reach[1] & ~lead) == 0u ? 3 : 4;
    }
    const int per = 32 >> lg;
    if (lg > 0 && le - lb <= NARROW_BALLOT_STEPS * per) {
      int total = 0;
      for (unsigned w = lead; w != 0u; w &= w - 1u) {
        const int q = __ffs(w) - 1;
        const double sp = __shfl_sync(FULL_MASK, sv, q);
        // ballot_parent's steps with rank `lane` read in the loop: through ballot_parent the
        // one-CTA kernel's code moved and measured up to 5% slower (tree_build.md, session 58).
        for (int r0 = 0; r0 < keff; r0 += 32) {
          const int r = r0 + lane;
          const double x = r < keff ? (double)row[r] : 0.0;
          const double sc = KD_DADD(sp, x);
          if (ballot_children(t, d, r < keff && sc >= tau, lb + q, r, sp, x, sc, le, room, total) != FULL_MASK) break;
        }
      }
      const int j = lane >> lg, r = lane & ((1 << lg) - 1);
      const double x = (double)row[r];
      for (int p0 = 0; p0 < le - lb; p0 += per) {
        const int q = p0 + j;  // <= 31
        const double sp = __shfl_sync(FULL_MASK, sv, q);
        const double sc = KD_DADD(sp, x);
        ballot_children(t, d, q < le - lb && !((lead >> q) & 1u) && sc >= tau, lb + q, r, sp, x, sc, le, room,
                        total);
      }
      __syncwarp();
      return total;
    }
  }
  const int p = lb + lane;
  const int c = p < le ? count_children(row, keff, t.score[p], tau) : 0;
  const int incl = warp_inclusive_scan(c, lane);
  const int total = __shfl_sync(FULL_MASK, incl, 31);
  for (int j0 = 0; j0 < total && j0 < room; j0 += 32) {
    const int j = j0 + lane, o = owner_lane(incl, j);
    const int first = __shfl_sync(FULL_MASK, incl - c, o);
    if (j < total && j < room) write_child(t, row, d, lb + o, j - first, le + j);
  }
  __syncwarp();
  return total;
}

// Levels from *d (parents [*lb, *le)) while they are narrow (at most 32 parents), by warp 0
// alone: a block level pays the block barrier, the counter and its read-back, and a
// budget-16 tree is often a chain of 15 such levels (docs/kernels/tree_build.md, v3g). Runs
// from the root, after a raise and after a wide level. Stops at the first wider level, at a
// level that would overflow the buffer (the block redoes it and raises tau) or at the tree's
// end (*d = L); the block goes on from *d. The level counters stay untouched: the caller has
// them at zero.
template <bool WIDE>
__device__ void narrow_levels(const Threshold& t, int L, int keff, double tau, int* d, int* lb,
                              int* le, int tid) {
  int* state = t.scratch + TS_NARROW;
  if (tid < 32) {
    int wd = *d, wlb = *lb, wle = *le;
    while (wd < L && wle - wlb <= 32) {
      const int total = materialise_narrow<WIDE>(t, t.lp + wd * t.ld, keff, wd, tau, wlb, wle, tid);
      if (total > t.cap - wle) break;
      if (total == 0) { wd = L; break; }
      wlb = wle;
      wle += total;
      ++wd;
      // Profile builds: the ends of narrow levels 1-7, 10 and 13.
      if (wd <= 7) KD_PROF(24 + wd); else if (wd == 10) KD_PROF(19); else if (wd == 13) KD_PROF(20);
    }
    if (tid == 0) { state[0] = wd; state[1] = wlb; state[2] = wle; }
  }
  __syncthreads();
  *d = state[0];
  *lb = state[1];
  *le = state[2];
}

// A narrow level after a wide one (a deep tree past its widest level) goes back to warp 0,
// as after a raise: a block level costs ~2k cycles of barriers and counters. Every thread
// has read the last level's count after the barrier; then all three counters are zero, as
// narrow_levels leaves them for the levels after it.
template <bool WIDE>
__device__ __forceinline__ void narrow_after_wide(const Threshold& t, int L, int keff, double tau, int* d, int* lb,
                                                  int* le, int tid) {
  if (*d < L && *le - *lb <= 32) {
    __syncthreads();
    clear_level_counters(t, tid);
    narrow_levels<WIDE>(t, L, keff, tau, d, lb, le, tid);
  }
}
#else
// Host twins: the host takes every level by the block path, one thread.
template <bool WIDE>
inline void narrow_levels(const Threshold&, int, int, double, int*, int*, int*, int) {}
template <bool WIDE>
inline void narrow_after_wide(const Threshold&, int, int, double, int*, int*, int*, int) {}
#endif

// Node i's 256-bit path key (16-bit digits rank + 1, most significant first), by a walk up.
KD_HD void write_key(const Threshold& t, int i) {
  uint64_t k0 = 0, k1 = 0, k2 = 0, k3 = 0;  // registers, not an indexed array (local memory)
  for (int x = i; x != 0;) {
    const uint32_t m = t.meta[x];
    const int d = ts_depth(m) - 1, w = d >> 2;
    const uint64_t v = (uint64_t)(ts_rank(m) + 1) << ((3 - (d & 3)) * 16);
    k0 |= w == 0 ? v : 0;
    k1 |= w == 1 ? v : 0;
    k2 |= w == 2 ? v : 0;
    k3 |= w == 3 ? v : 0;
    x = ts_parent(m);
  }
  uint64_t* k = t.keys + (size_t)i * KEY_WORDS;
  k[0] = k0; k[1] = k1; k[2] = k2; k[3] = k3;
}

// The spec's order: higher score, then the smaller rank path. Pads (idx >= cap) last.
KD_HD bool item_better(const Threshold& t, const SortItem& a, const SortItem& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.k0 != b.k0) return a.k0 < b.k0;
  if (a.idx >= t.cap || b.idx >= t.cap) return a.idx < b.idx;
  for (int w = 1; w < KEY_WORDS; ++w) {
    const uint64_t ka = t.keys[(size_t)a.idx * KEY_WORDS + w], kb = t.keys[(size_t)b.idx * KEY_WORDS + w];
    if (ka != kb) return ka < kb;
  }
  return false;
}

#ifdef __CUDA_ARCH__
// (u, k0..k3) < (v, l0..l3) for 320-bit keys, most significant word first: the borrow out
// of their difference, branch-free (ten integer adds with carry on the SASS side).
__device__ __forceinline__ int key_less(uint64_t u, uint64_t k0, uint64_t k1, uint64_t k2, uint64_t k3,
                                        uint64_t v, uint64_t l0, uint64_t l1, uint64_t l2, uint64_t l3) {
  uint32_t borrow;
  asm("{\n\t.reg .u64 d;\n\t"
      "sub.cc.u64 d, %1, %6;\n\t"
      "subc.cc.u64 d, %2, %7;\n\t"
      "subc.cc.u64 d, %3, %8;\n\t"
      "subc.cc.u64 d, %4, %9;\n\t"
      "subc.cc.u64 d, %5, %10;\n\t"
      "subc.u32 %0, 0, 0;\n\t}"
      : "=r"(borrow)
      : "l"(k3), "l"(k2), "l"(k1), "l"(k0), "l"(u), "l"(l3), "l"(l2), "l"(l1), "l"(l0), "l"(v));
  return (int)(borrow & 1u);
}

// (u, k0, k1) < (v, l0, l1): key_less for short keys (k2 = k3 = 0).
__device__ __forceinline__ int key_less2(uint64_t u, uint64_t k0, uint64_t k1, uint64_t v, uint64_t l0,
                                         uint64_t l1) {
  uint32_t borrow;
  asm("{\n\t.reg .u64 d;\n\t"
      "sub.cc.u64 d, %1, %4;\n\t"
      "subc.cc.u64 d, %2, %5;\n\t"
      "subc.cc.u64 d, %3, %6;\n\t"
      "subc.u32 %0, 0, 0;\n\t}"
      : "=r"(borrow)
      : "l"(k1), "l"(k0), "l"(u), "l"(l1), "l"(l0), "l"(v));
  return (int)(borrow & 1u);
}

// A score as a key where smaller is better: scores here are <= 0 (the certificate), and
// for those the bits order by magnitude once +0.0 is folded onto -0.0 (the sign bit set).
__device__ __forceinline__ uint64_t score_key(double x) {
  return (uint64_t)__double_as_longlong(x) | 0x8000000000000000ull;
}

// 1 where node j comes before the node of score key u and path key k0..k3 (the spec's
// order): one broadcast load of j's score and key, one branch-free compare.
__device__ __forceinline__ int node_before(const Threshold& t, int j, uint64_t u, uint64_t k0, uint64_t k1,
                                           uint64_t k2, uint64_t k3) {
  const ulonglong2 a = *reinterpret_cast<const ulonglong2*>(t.keys + (size_t)j * KEY_WORDS);
  const ulonglong2 b = *reinterpret_cast<const ulonglong2*>(t.keys + (size_t)j * KEY_WORDS + 2);
  return key_less(score_key(t.score[j]), a.x, a.y, b.x, b.y, u, k0, k1, k2, k3);
}

// node_before where no node lies deeper than SHORT_KEY_DEPTH: a load less.
__device__ __forceinline__ int node_before2(const Threshold& t, int j, uint64_t u, uint64_t k0, uint64_t k1) {
  const ulonglong2 a = *reinterpret_cast<const ulonglong2*>(t.keys + (size_t)j * KEY_WORDS);
  return key_less2(score_key(t.score[j]), a.x, a.y, u, k0, k1);
}

// How many of the nodes idx(q), q in [q0, q1), come before the node of score key u and path
// key k0..k3 (the ranks' inner loop): node_before each, or node_before2 where short_keys (no
// node deeper than SHORT_KEY_DEPTH: the keys' first two words order them, 16 bytes fewer a load).
template <class Index>
__device__ __forceinline__ int count_before(const Threshold& t, int q0, int q1, Index idx, bool short_keys,
                                            uint64_t u, uint64_t k0, uint64_t k1, uint64_t k2, uint64_t k3) {
  int better = 0;
  if (short_keys) {
#pragma unroll 4
    for (int q = q0; q < q1; ++q) better += node_before2(t, idx(q), u, k0, k1);
  } else {
#pragma unroll 4
    for (int q = q0; q < q1; ++q) better += node_before(t, idx(q), u, k0, k1, k2, k3);
  }
  return better;
}

// rank_count's m^2 compares up to this many candidates; above, bucket_rank's m x (mean bin)
// cost less (docs/kernels/tree_build.md, session 52).
constexpr int RANK_COUNT_MAX = 128;

// The place of node e + 1 among nodes 1 .. m, best first, into t.pos[e] (which the caller
// zeroes), for m <= RANK_COUNT_MAX: the number of nodes better than it, counted against
// every other node: a broadcast load of its score and path key and one branch-free 320-bit
// compare each. m^2 compares, but no barrier or dependent search between them (the merge
// below spent 3.5k cycles on its warp stage and ~3k on each merge level). Each warp counts
// for 32 nodes against one slice of the nodes (slices keep all warps busy at small m).
// The split's divisions are small_div's (five integer divisions here were ~100 instructions
// and their latency in front of the count; ncu). short_keys: as in count_before.
__device__ void rank_count(const Threshold& t, int m, bool short_keys, int tid, int nthreads) {
  const int lane = tid & 31, warp = tid >> 5, groups = max(1, (m + 31) >> 5);
  const int slices = max(1, small_div(nthreads >> 5, groups));
  if (warp < groups * slices) {
    const int h = small_div(warp, groups), e = (warp - h * groups) * 32 + lane;
    const int lo = small_div(h * m, slices), hi = small_div((h + 1) * m, slices);
    const int me = e < m ? e + 1 : 1;  // lanes past m count for node 1 and drop it
    const uint64_t u = score_key(t.score[me]);
    const uint64_t* k = t.keys + (size_t)me * KEY_WORDS;
    const uint64_t k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
    const int better = count_before(t, lo + 1, hi + 1, [](int j) { return j; }, short_keys, u, k0, k1, k2, k3);
    if (e < m) atomicAdd(&t.pos[e], better);
  }
  KD_PROF(9);
  __syncthreads();
}

// rank_count's places for any m <= cap, by buckets: the candidates go into nb linear score
// bins, best bin first (a histogram, its scan, a scatter of each bin's members), and a node's
// place is its bin's start plus the members of its own bin that are better (the same
// branch-free compare). Work is m times the mean bin size (~15 on sweep inputs; bins of
// exact ties hold a few hundred), not the merge sort's log^2 m dependent rounds. Scratch
// over t.items (dead until the host-style emit): start and fill [nb = cap], members [m].
#ifndef KD_BUCKET_MAX
#define KD_BUCKET_MAX 128
#endif
#ifndef KD_BUCKET_SORT
#define KD_BUCKET_SORT 1  // A/B builds: 0 merge-sorts every candidate set past RANK_COUNT_MAX
#endif
constexpr int BUCKET_MAX = KD_BUCKET_MAX;

__device__ bool bucket_rank(const Threshold& t, int m, double tau, bool short_keys, int tid, int nthreads) {
  const int nb = t.cap;
  int* start = reinterpret_cast<int*>(t.items);
  int* fill = start + nb;
  int* members = fill + nb;
  const double lo = tau, hi = t.score[1];  // node 1 (0^1) scores highest: rows are sorted
  const double scale = hi > lo ? (double)nb / (hi - lo) : 0.0;
  for (int i = tid; i < nb; i += nthreads) { start[i] = 0; fill[i] = 0; }
  __syncthreads();
  for (int e = tid; e < m; e += nthreads)
    atomicAdd(&start[nb - 1 - score_bin(t.score[e + 1], lo, scale, nb)], 1);
  __syncthreads();
  // A bin of more than BUCKET_MAX (exact ties, mostly) would cost its size squared: decline,
  // and the caller merge-sorts instead.
  bool big = false;
  for (int i = tid; i < nb; i += nthreads) big |= start[i] > BUCKET_MAX;
  if (__syncthreads_or(big)) return false;
  block_exclusive_scan(start, nb, t.scratch, tid, nthreads);
  for (int e = tid; e < m; e += nthreads) {
    const int bin = nb - 1 - score_bin(t.score[e + 1], lo, scale, nb);
    members[start[bin] + atomicAdd(&fill[bin], 1)] = e + 1;
  }
  __syncthreads();
  // By member slot, not node: a warp's lanes share a bin (or two), so they walk the same
  // members with broadcast loads and no lane waits on a larger bin than its own.
  for (int s = tid; s < m; s += nthreads) {
    const int i = members[s];
    const int bin = nb - 1 - score_bin(t.score[i], lo, scale, nb);
    const uint64_t u = score_key(t.score[i]);
    const uint64_t* k = t.keys + (size_t)i * KEY_WORDS;
    const uint64_t k0 = k[0], k1 = k[1], k2 = k[2], k3 = k[3];
    const int b0 = start[bin], b1 = b0 + fill[bin];
    t.pos[i - 1] = b0 + count_before(t, b0, b1, [&](int q) { return members[q]; }, short_keys, u, k0, k1, k2, k3);
  }
  __syncthreads();
  return true;
}

// The pops straight from rank_count's places: node i = e + 1 is pop t.pos[e] + 1 where
// that place is < n. One pass over the nodes writes out.nodes and the links and checks the
// certificate's last conditions (exact sums, parents popped); no sorted list is laid out
// (v3h: a scatter, a clear of the pop indices and a pass over the sorted list, three more
// barriers and ~1.5k cycles, much of it instruction fetch at the kernel's end, ncu).
// Returns false where the check fails.
__device__ bool emit_by_rank(const Threshold& t, int m, int n, const Selection& out, int tid, int nthreads) {
  bool bad = false;
  for (int e = tid; e < m; e += nthreads) {
    const int r = t.pos[e];
    if (r >= n) continue;
    const uint32_t mi = t.meta[e + 1];
    const int p = ts_parent(mi), pr = p == 0 ? -1 : t.pos[p - 1];
    const int pp = p == 0 ? 0 : (pr < n ? pr + 1 : 0);
    bad |= ts_inexact(mi) || (p != 0 && pp == 0);
    out.nodes[r + 1] = pack_node(pp, ts_rank(mi), ts_depth(mi));
    if (ts_rank(mi) == 0) out.next_token[pp] = (int16_t)(r + 1);
    // The next sibling (next rank) is the next node of the buffer if it has this parent.
    if (e + 1 < m && ts_parent(t.meta[e + 2]) == p && t.pos[e + 1] < n)
      out.next_sibling[r + 1] = (int16_t)(t.pos[e + 1] + 1);
  }
  return __syncthreads_or(bad) == 0;
}

// The pops by ranks where the candidates allow (rank_count up to RANK_COUNT_MAX, else
// bucket_rank unless a bin is too tied): true with *popped = n, or -1 where the certificate
// fails; false leaves them to sort_items.
__device__ __forceinline__ bool rank_and_emit(const Threshold& t, int m, int n, double tau, bool short_keys,
                                              const Selection& out, int tid, int nthreads, int* popped) {
  const bool ranked = m <= RANK_COUNT_MAX ? (rank_count(t, m, short_keys, tid, nthreads), true)
                                          : KD_BUCKET_SORT && bucket_rank(t, m, tau, short_keys, tid, nthreads);
  if (!ranked) return false;
  KD_PROF(4);
  *popped = emit_by_rank(t, m, n, out, tid, nthreads) ? n : -1;
  return true;
}
#else
// Host twin: the host sorts every candidate set (sort_items' bitonic network).
inline bool rank_and_emit(const Threshold&, int, int, double, bool, const Selection&, int, int, int*) {
  return false;
}
#endif

// Items 0 .. m-1 := nodes 1 .. m, sorted best first (on the device only for more than
// RANK_COUNT_MAX nodes whose bins bucket_rank declines). Device: a thread holds items
// e = s * nthreads + tid (pads past m, up to P = the next power of two >= 32, sort last);
// each warp first sorts its 32 in registers (bitonic on shuffles; warps holding only
// positions >= P sit it out), then runs of 32, 64, ... are merged pairwise by rank: an
// item's place in the merged run is its index in its own run plus the number of items of
// the partner run that are better (a branchless binary search: the partner run is sorted
// and the order is total), so every level is one read pass and one write pass. v3c
// ran the whole bitonic network (45 stages at P 512, ten through shared memory, every
// warp in every stage): 19k cycles at budget 256, 72k at 1024. Host: the plain network.
constexpr int TS_SORT_SLOTS = 4;  // items a thread holds: cap / threads <= 2048 / 512

#ifdef __CUDA_ARCH__
__device__ inline void sort_items(const Threshold& t, int m, int tid, int nthreads) {
  const int cap = t.cap;
  int P = 32;
  while (P < m) P <<= 1;
  SortItem it[TS_SORT_SLOTS];
  int pos[TS_SORT_SLOTS];
  const int warp_first = tid & ~31;
#pragma unroll
  for (int s = 0; s < TS_SORT_SLOTS; ++s) {
    const int e = s * nthreads + tid;
    pos[s] = e;
    it[s] = e < m ? SortItem{t.score[e + 1], t.keys[(size_t)(e + 1) * KEY_WORDS], e + 1, 0}
                  : SortItem{-INFINITY, 0, cap + e, 0};
    if (s * nthreads + warp_first >= P) continue;  // warp-uniform: the warp holds no position < P
    for (int k = 2; k <= 32; k <<= 1)
      for (int j = k >> 1; j > 0; j >>= 1) {
        SortItem o;
        o.score = __shfl_xor_sync(FULL_MASK, it[s].score, j);
        o.k0 = __shfl_xor_sync(FULL_MASK, it[s].k0, j);
        o.idx = __shfl_xor_sync(FULL_MASK, it[s].idx, j);
        // Directions from the lane, not the position: every run ends up best first.
        const int lane = tid & 31;
        const bool take_better = ((lane & j) == 0) == ((lane & k) == 0);
        if (item_better(t, o, it[s]) == take_better) it[s] = o;
      }
  }
  KD_PROF(9);
  for (int run = 32; run < P; run <<= 1) {
#pragma unroll
    for (int s = 0; s < TS_SORT_SLOTS; ++s)
      if (pos[s] < P) t.items[pos[s]] = it[s];
    __syncthreads();
    int next[TS_SORT_SLOTS], cnt[TS_SORT_SLOTS], other[TS_SORT_SLOTS];
#pragma unroll
    for (int s = 0; s < TS_SORT_SLOTS; ++s) {
      const int base = pos[s] & ~(2 * run - 1), within = pos[s] - base;
      other[s] = base + (within < run ? run : 0);
      next[s] = base + (within & (run - 1));
      cnt[s] = 0;
    }
    // cnt = how many of the partner run are better: steps run/2, ..., 1, then one more.
    for (int step = run >> 1; step > 0; step >>= 1)
#pragma unroll
      for (int s = 0; s < TS_SORT_SLOTS; ++s)
        if (pos[s] < P && item_better(t, t.items[other[s] + cnt[s] + step - 1], it[s])) cnt[s] += step;
#pragma unroll
    for (int s = 0; s < TS_SORT_SLOTS; ++s)
      if (pos[s] < P && item_better(t, t.items[other[s] + cnt[s]], it[s])) cnt[s] += 1;
    __syncthreads();  // every read of this level is done before the items move
#pragma unroll
    for (int s = 0; s < TS_SORT_SLOTS; ++s) pos[s] = next[s] + cnt[s];
    KD_PROF(10 + 31 - __clz(run) - 5);
  }
#pragma unroll
  for (int s = 0; s < TS_SORT_SLOTS; ++s)
    if (pos[s] < P) t.items[pos[s]] = it[s];
  __syncthreads();
}
#else
inline void sort_items(const Threshold& t, int m, int tid, int nthreads) {
  const int cap = t.cap;
  (void)nthreads;
  int P = 1;
  while (P < m) P <<= 1;
  for (int i = tid; i < P; ++i)
    t.items[i] = i < m ? SortItem{t.score[i + 1], t.keys[(size_t)(i + 1) * KEY_WORDS], i + 1, 0}
                       : SortItem{-INFINITY, 0, cap + i, 0};
  for (int k = 2; k <= P; k <<= 1)
    for (int j = k >> 1; j > 0; j >>= 1)
      for (int q = 0; q < P / 2; ++q) {
        const int i = ((q & ~(j - 1)) << 1) | (q & (j - 1)), l = i | j;
        const SortItem a = t.items[i], b = t.items[l];
        if ((i & k) == 0 ? item_better(t, b, a) : item_better(t, a, b)) { t.items[i] = b; t.items[l] = a; }
      }
}
#endif

#ifdef __CUDA_ARCH__
__device__ inline bool block_any(bool x) {
  return __syncthreads_or(x) != 0;
}
#else
inline bool block_any(bool x) {
  return x;
}
#endif

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
constexpr int START_PIVOTS = 16;
constexpr int START_SLOTS = 5;  // pairs a lane holds: L (L + 1) / 2 <= 136 = 32 x 4.25
constexpr double START_MARGIN = 1.0 / 17592186044416.0;  // 2^-44
#ifndef KD_START_ROUNDS
#define KD_START_ROUNDS 2  // a third round's searches cost more than the raises it saved
#endif
constexpr int START_ONE_ROUND_BUDGET = 16;  // up to this budget one round left no raise (sweep inputs)

// Pivot rounds of the start and level bounds for `budget`: one round's bound is loose by a
// 17th of the range, which small budgets absorb (budget 64 then raises: docs/kernels/tree_build.md,
// session 26).
KD_HD int start_rounds(int budget) { return budget <= START_ONE_ROUND_BUDGET ? 1 : KD_START_ROUNDS; }

// How the pivots of a bound's rounds lie: `pivots` (<= 32) a round over [lo, hi], evenly,
// or (`squared`) at the squares of the even fractions, dense near lo: the budget-th score
// of the chain's nodes lies in the lowest quarter of [tau, lp[0][0]] for 90% of the sweep's
// requests (both drafters, budgets 64-256: session 28), so there one round of squared
// pivots comes close to what two even rounds reach.
// `step` is 1 / (count + 1), made by make_pivots from the constant counts its callers
// pass: no division on the latency-bound start path.
struct Pivots {
  int count, rounds;
  bool squared;
  double step;
};
KD_HD constexpr Pivots make_pivots(int count, int rounds, bool squared) {
  return Pivots{count, rounds, squared, 1.0 / (count + 1)};
}
KD_HD Pivots even_pivots(int budget) { return make_pivots(START_PIVOTS, start_rounds(budget), false); }
// Past START_ONE_ROUND_BUDGET and up to this budget the chain bound, and the one-deviation
// bound at small batches, take one round of squared pivots (dev_pivots, chain_pivots).
constexpr int SQUARED_ROUND_BUDGET = 64;

// The one-deviation bound's pivots: one squared round at batches up to DEV_ONE_ROUND_MAX_BATCH
// (one ~3.5k-cycle round less, up to ~40% more candidates: a batch's time is its slowest
// request's, so from batch 64 the candidates' tail costs more than the round).
constexpr int DEV_ONE_ROUND_MAX_BATCH = 16;
KD_HD Pivots dev_pivots(int budget, int batch) {
  return budget > START_ONE_ROUND_BUDGET && budget <= SQUARED_ROUND_BUDGET && batch <= DEV_ONE_ROUND_MAX_BATCH
             ? make_pivots(START_PIVOTS, 1, true)
             : even_pivots(budget);
}

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

// How many r in [1, keff) of a sorted row have row[r] >= y (yf = float_at_or_above(y)):
// a branch-free search in power-of-two steps (top: the highest power of two <= keff - 1),
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

__device__ double deviation_bound_device(const Threshold& t, int L, int keff, int budget, double tau, int tid,
                                         int nthreads) {
  if (nthreads < 32 * START_PIVOTS) return tau;  // a warp a pivot
  const int lane = tid & 31, np = L * (L + 1) / 2;
  int top = 1;
  while (2 * top <= keff - 1) top <<= 1;
  // Lane d: chain(d), the heap's sum to node 0^d (chain(L) on lane L; L <= 16).
  share_chain_sums(t, L, tid);
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
  const double lo = pivot_rounds<32>(t, tau, (double)t.lp[0], budget, dev_pivots(budget, (int)gridDim.x), 17, tid,
                                     [&](double x, int lane) {
    int n = lane >= 1 && lane <= L && c >= x;  // the chain node 0^lane
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
  int top = 1;
  while (2 * top <= keff - 1) top <<= 1;
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
__device__ inline double deviation_bound(const Threshold& t, int L, int keff, int budget, double tau, int tid,
                                         int nthreads) {
  return deviation_bound_device(t, L, keff, budget, tau, tid, nthreads);
}
#else
inline double deviation_bound(const Threshold& t, int L, int keff, int budget, double tau, int tid, int nthreads) {
  (void)tid; (void)nthreads;
  return deviation_bound_host(t, L, keff, budget, tau);
}
#endif

// Pivot rounds over the chain's own nodes 0^d r only (the heap's exact sums, one binary
// search per depth): ~4k cycles against deviation_bound's ~20k, and as good where K >=
// budget (no raises at the sweep's shapes), so it serves there. Past START_ONE_ROUND_BUDGET
// and up to SQUARED_ROUND_BUDGET one round of 32 squared pivots at any batch (a round costs
// its latency, ~1.3k cycles at 16 or 32 pivots), the node buffer made 4x the budget for the
// looser tau (see ts_capacity); elsewhere the even pivots (budget 16: one round of 16 was
// 2-4% faster than 32 squared ones at batch 16-256).
KD_HD Pivots chain_pivots(int budget) {
  return budget > START_ONE_ROUND_BUDGET && budget <= SQUARED_ROUND_BUDGET ? make_pivots(32, 1, true)
                                                                          : even_pivots(budget);
}

// Node buffer size for a budget: twice the next power of two (the sort pads to one), four
// times from batches of 16 (`batched`) up to WIDE_BUFFER_BUDGET: there ranking up to 4x the
// budget costs less than the raise an overflow takes; at budget 256 the larger candidate
// sets cost more than that at batch 256 (docs/kernels/tree_build.md). At budgets <= 16 both
// give the TS_MIN_NODES minimum.
constexpr int WIDE_BUFFER_BUDGET = 128;
KD_HD int ts_capacity(int budget, bool batched) {
  const int mult = batched && budget <= WIDE_BUFFER_BUDGET ? 4 : 2;
  int c = TS_MIN_NODES;
  while (c < mult * budget && c < TS_MAX_NODES) c <<= 1;
  return c;
}

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

// Turns node i's key (write_key's) into that of its child of rank r: the digit of
// depth(i) + 1 set.
KD_HD void to_child_key(const Threshold& t, int i, int r) {
  const int d = ts_depth(t.meta[i]);  // the child's digit index
  t.keys[(size_t)i * KEY_WORDS + (d >> 2)] |= (uint64_t)(r + 1) << ((3 - (d & 3)) * 16);
}

// A raise where level d + 1 overflows (parents [lb, le) at level d): the highest pivot x
// of [tau, lp[0][0]] that the nodes of levels <= d ([1, le), all >= tau) and every child
// of the parents (counted by binary search, not stored) reach `budget` times. The
// materialised part of the overflowing level is a biased sample (the first parents'
// children, up to the buffer's end), and its budget-th best crept up one distinct score a
// raise on coarse rows (docs/kernels/tree_build.md, session 21); the full level's count
// lands within a raise or two. Exact sums, so the pivot is a lower bound as it stands.
// Only where the level has at most LEVEL_RAISE_MAX parents (a warp's searches a pivot)
// and holds more than LEVEL_RAISE_OVER times the room: a level that nearly fits is nearly
// all materialised, and raise_tau's pick from it is as high for less.
// Device: each parent's searches stay within its count at tau, which materialise_level
// leaves in t.pos (most parents of an overflowing level have a few children, many none).
#ifndef KD_LEVEL_RAISE
#define KD_LEVEL_RAISE 1
#endif
constexpr int LEVEL_RAISE_MAX = 512, LEVEL_RAISE_OVER = 2;

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

// The next double above x (x finite, not the largest): order keys are consecutive.
KD_HD double next_up(double x) { return from_order_key(order_key(x) + 1); }

// True where every depth's best log-prob is < 0: then every child scores below its parent,
// and a node scoring exactly t* (the budget-th best) is a leaf whose parent scores above it.
KD_HD bool ties_are_leaves(const Threshold& t, int L) {
  for (int d = 0; d < L; ++d)
    if (!((double)t.lp[d * t.ld] < 0.0)) return false;
  return true;
}

// Ties at the budget-th score t = tie_tau, where they alone fill the node buffer. On entry
// nodes [0, le) are the root and S(> t), fewer than `budget`, lp still staged. The heap pops
// all of them, then the `want` tied nodes smallest in path order. A tied node is a leaf
// child of a node of [0, le) (ties_are_leaves), and a parent's tied children are one rank
// range [lo, lo + c) (rows sorted, exact sums: all the same log-prob, checked). Path order
// of two tied nodes with parents p, q is that of p's child lo_p and q's child lo_q: p's
// children ranked below lo_p score above t, so q inside p's subtree hangs below a child
// < lo_p. So the parents with ties are ranked by the key of their child lo (a count over
// the other such parents), and the first `want` tied children in that order join the
// buffer with score t (the buffer reordered so that siblings stay adjacent). Returns the
// new le (le + want), or -1 (an inexact sum, or fewer ties than wanted: the caller's warp
// loop then builds the tree). Scratch over t.items: lo, count, compaction slots (then
// offsets), parents with ties, the same by rank [cap] each; path keys over lp (a tied
// parent's turned into its child lo's; dead after).
KD_HD int select_ties(const Threshold& t, int L, int keff, double tie_tau, int le, int want, int tid,
                      int nthreads) {
  const int cap = t.cap;
  int* lo_of = reinterpret_cast<int*>(t.items);  // t.items holds 6 cap ints
  int* cnt = lo_of + cap;
  int* slot = cnt + cap;
  int* blk = slot + cap;
  int* by_rank = blk + cap;
  const double above = next_up(tie_tau);
  bool bad = false;
  for (int i = tid; i < le; i += nthreads) {
    const int d = ts_depth(t.meta[i]);
    int lo = 0, c = 0;
    if (d < L) {
      const float* row = t.lp + d * t.ld;
      const double sp = t.score[i];
      lo = count_children(row, keff, sp, above);
      c = count_children(row, keff, sp, tie_tau) - lo;
      if (c > 0) {
        const double x = (double)row[lo];
        bad |= (double)row[lo + c - 1] != x || KD_DADD(sp, x) != tie_tau || !exact_sum(sp, x, tie_tau);
      }
    }
    lo_of[i] = lo;
    cnt[i] = c;
  }
  if (block_any(bad)) return -1;
  for (int i = tid; i < le; i += nthreads) {
    write_key(t, i);  // over lp: its last read is above
    if (cnt[i] > 0) to_child_key(t, i, lo_of[i]);  // the block's key, once (the ranks read it nb times)
    slot[i] = cnt[i] > 0;
  }
  KD_BARRIER();
  // The parents with ties, compacted, then ranked by the key of their child lo: how many
  // others have a smaller one (keys differ: each names a distinct node).
  const int nb = block_exclusive_scan(slot, le, t.scratch, tid, nthreads);
  for (int i = tid; i < le; i += nthreads)
    if (cnt[i] > 0) blk[slot[i]] = i;
  KD_BARRIER();
  for (int x = tid; x < nb; x += nthreads) {
    const int i = blk[x];
    uint64_t a[KEY_WORDS];
    for (int w = 0; w < KEY_WORDS; ++w) a[w] = t.keys[(size_t)i * KEY_WORDS + w];
    int r = 0;
    for (int y = 0; y < nb; ++y) {
      const uint64_t* b = t.keys + (size_t)blk[y] * KEY_WORDS;
      int w = 0;
      while (w < KEY_WORDS - 1 && b[w] == a[w]) ++w;
      r += b[w] < a[w];
    }
    by_rank[r] = i;
  }
  KD_BARRIER();
  int* offset = slot;  // the compaction's indices are dead
  for (int r = tid; r < nb; r += nthreads) offset[r] = cnt[by_rank[r]];
  KD_BARRIER();
  const int total = block_exclusive_scan(offset, nb, t.scratch, tid, nthreads);
  if (total < want) return -1;
  for (int r = tid; r < nb; r += nthreads) {  // cnt := how many of each block are taken
    const int i = by_rank[r], at = offset[r];
    cnt[i] = at >= want ? 0 : (cnt[i] < want - at ? cnt[i] : want - at);
  }
  KD_BARRIER();
  // Emit links a node to its next sibling by buffer adjacency, so a taken block goes right
  // after its parent's child lo - 1 (ins: how many go after each node; pred: that child),
  // or, where lo = 0 (no other children), after everything (tail: offsets among those).
  int* ins = slot;
  int* pred = blk;
  int* tail = by_rank;
  for (int i = tid; i < le; i += nthreads) {
    ins[i] = 0;
    tail[i] = cnt[i] > 0 && lo_of[i] == 0 ? cnt[i] : 0;
  }
  KD_BARRIER();
  for (int i = 1 + tid; i < le; i += nthreads) {
    const int p = ts_parent(t.meta[i]);
    if (cnt[p] > 0 && ts_rank(t.meta[i]) == lo_of[p] - 1) {
      ins[i] = cnt[p];
      pred[p] = i;
    }
  }
  KD_BARRIER();
  const int mid = block_exclusive_scan(ins, le, t.scratch, tid, nthreads);
  block_exclusive_scan(tail, le, t.scratch, tid, nthreads);
  // The new buffer, staged over the path keys (dead: the caller writes them again): node i
  // moves to i + ins[i] (ins now its exclusive scan), parents remapped.
  double* nscore = reinterpret_cast<double*>(t.keys);
  uint32_t* nmeta = reinterpret_cast<uint32_t*>(nscore + cap);
  for (int i = tid; i < le; i += nthreads) {
    const uint32_t m = t.meta[i];
    const int p = ts_parent(m), ni = i + ins[i];
    nscore[ni] = t.score[i];
    nmeta[ni] = i == 0 ? m : ts_meta(p + ins[p], ts_rank(m), ts_depth(m), ts_inexact(m));
    if (cnt[i] > 0) {
      const int at = lo_of[i] > 0 ? pred[i] + ins[pred[i]] + 1 : le + mid + tail[i];
      for (int j = 0; j < cnt[i]; ++j) {
        nscore[at + j] = tie_tau;
        nmeta[at + j] = ts_meta(ni, lo_of[i] + j, ts_depth(m) + 1, false);
      }
    }
  }
  KD_BARRIER();
  for (int i = tid; i < le + want; i += nthreads) {
    t.score[i] = nscore[i];
    t.meta[i] = nmeta[i];
  }
  KD_BARRIER();
  return le + want;
}

#ifndef KD_DEEP_GATE
#define KD_DEEP_GATE 1  // A/B builds: 0, a deep tree takes the start bound the batch gate gives any tree
#endif
constexpr int DEEP_CHAIN = 8;      // the chain depth that marks a deep tree
constexpr int DEEP_KEFF_MIN = 32;  // narrower rows: the chain bound leaves no raise to save
#ifndef KD_DEEP_KEFF_MAX
#define KD_DEEP_KEFF_MAX 256  // A/B builds: other widths (64 before the one-deviation layout)
#endif
constexpr int DEEP_KEFF_MAX = KD_DEEP_KEFF_MAX;  // the widest rows whose deep trees skip the chain bound

// Whether node 0^DEEP_CHAIN (L >= DEEP_CHAIN) scores about tau or above: a float sum, as it
// only picks a bound and sits on every request's path (the heap's double sums cost more).
KD_HD bool deep_chain(const Threshold& t, double tau) {
  float c = 0.0f;
  for (int d = 0; d < DEEP_CHAIN; ++d) c += t.lp[d * t.ld];
  return (double)c >= tau;
}

#ifndef KD_ONE_DEV_LAYOUT
#define KD_ONE_DEV_LAYOUT 1  // A/B builds: 0 never
#endif
constexpr int ONE_DEV_SCRATCH = 64;  // scratch ints past block_exclusive_scan's and the pivot counts

#ifndef KD_ONE_DEV_KEYS
#define KD_ONE_DEV_KEYS 1  // A/B builds: 0 walks up for every key, laid out or not
#endif
#ifndef KD_ONE_DEV_DEAL_MIN
#define KD_ONE_DEV_DEAL_MIN 128  // A/B builds: 1 deals at every width, 1 << 30 never
#endif
// The narrowest rows whose layout deals the deviations over all threads; narrower rows give
// a warp few enough that one warp a depth costs less than the block scan.
constexpr int ONE_DEV_DEAL_MIN = KD_ONE_DEV_DEAL_MIN;

// A laid-out node's deviation as a tag: (a << 16) | r for a node on 0^a r's line, 0 on the
// chain. Tags sit past the layout's doubles over the sort items (free until the sort).
KD_HD int* one_dev_tags(const Threshold& t) { return reinterpret_cast<int*>(t.items) + 128; }
static_assert((3 * KEY_DEPTH + 1) * sizeof(double) <= 128 * sizeof(int), "the tags start past the staged doubles");
static_assert((128 + TS_MIN_NODES) * sizeof(int) <= TS_MIN_NODES * sizeof(SortItem),
              "a tag a node fits over the sort items at every buffer size");
KD_HD void one_dev_tag(const Threshold& t, int i, int a, int r) {
  if (KD_ONE_DEV_KEYS) one_dev_tags(t)[i] = (a << 16) | r;
}

// write_key's key for node i of a laid-out tree, from its depth and tag: digit d is rank + 1,
// so 1 everywhere but the deviation's depth a, where it is r + 1.
KD_HD void write_one_dev_key(const Threshold& t, int i) {
  const int depth = ts_depth(t.meta[i]), tag = one_dev_tags(t)[i], a = tag >> 16, r = tag & 0xffff;
  uint64_t* k = t.keys + (size_t)i * KEY_WORDS;
  for (int w = 0; w < KEY_WORDS; ++w) {
    const int n = depth - 4 * w < 0 ? 0 : (depth - 4 * w > 4 ? 4 : depth - 4 * w);  // digits in word w
    uint64_t v = n == 0 ? 0 : (0x0001000100010001ull >> (16 * (4 - n))) << (16 * (4 - n));
    if (r > 0 && (a >> 2) == w) v += (uint64_t)r << ((3 - (a & 3)) * 16);
    k[w] = v;
  }
}

// S(tau) of a deep tree laid out at once, where no node of it lies two deviations off the
// first-child chain: every node is 0^d or 0^a r 0^b (r >= 1), so the chain's child counts
// and one walk down each deviation's first-child line give all of it, instead of one step
// a level (a confident drafter's fifteen narrow levels). Layout: the root, then the
// children of each chain node 0^0 .. 0^(L-1) (ranks ascending; 0^(a+1) first), then each
// deviation's line below it, contiguous: siblings adjacent, ranks ascending, parents first,
// as the level layout lays them. Checked, not assumed: a rank-1 child >= tau of any node on
// a line (a second deviation) makes it decline. Returns the node count with the root, or
// -1 where it declines (nothing written; the levels run instead): a second deviation, or
// more nodes than the buffer holds.
#ifdef __CUDA_ARCH__
// The line of deviation 0^a r (parent chain(a) = ca): visit(-1, ...) for 0^a r itself, then
// visit(k, parent score, x, score) for each first child k = 0, 1, .. scoring >= tau, over the
// rows' staged first two log-probs x0, x1. Returns how many, or -1 where a node on it has a
// rank-1 child >= tau (a second deviation).
template <class Visit>
__device__ __forceinline__ int one_dev_walk(const Threshold& t, const double* x0, const double* x1, int L,
                                            double tau, int a, int r, double ca, Visit&& visit) {
  const double x = (double)t.lp[a * t.ld + r];
  double sc = KD_DADD(ca, x);
  visit(-1, ca, x, sc);
  bool on = true, two = false;
  int below = 0;
#pragma unroll
  for (int j = 1; j < KEY_DEPTH; ++j) {
    if (!on || j <= a || j >= L) continue;
    const double y0 = x0[j], y1 = x1[j], next = KD_DADD(sc, y0);
    two |= KD_DADD(sc, y1) >= tau;
    on = next >= tau;
    if (on) {
      visit(below, sc, y0, next);
      sc = next;
      ++below;
    }
  }
  return two ? -1 : below;
}

// Writes the line of deviation 0^a r: the deviation at buffer index parent (its place among
// 0^a's children), then its first-child line at i, i + 1, .. (each its predecessor's child).
__device__ __forceinline__ void one_dev_write_line(const Threshold& t, const double* x0, const double* x1,
                                                   const int* first, int L, double tau, int a, int r,
                                                   double ca, int i, int parent) {
  one_dev_walk(t, x0, x1, L, tau, a, r, ca, [&](int k, double sp, double x, double sc) {
    if (k < 0) {
      store_child(t, a, a == 0 ? 0 : first[a - 1], r, parent, sp, x, sc);
      one_dev_tag(t, parent, a, r);
      return;
    }
    store_child(t, a + 1 + k, parent, 0, i, sp, x, sc);
    one_dev_tag(t, i, a, r);
    parent = i++;
  });
}

// Warp 0 of a layout, lane a for depth a: chain(a), the count of 0^a's children >= tau and the
// buffer index of the first (the chain nodes' children laid out by one warp scan), the row's
// first two log-probs as doubles, all the chain nodes' children, and for the dealt layout the
// deviations of the chain nodes before 0^a (a second scan).
template <bool Dealt>
__device__ __forceinline__ void one_dev_count_chain(const Threshold& t, int L, int keff, double tau, int lane,
                                                    int* cnt, int* first, int* kids, int* devs, double* cs,
                                                    double* x0, double* x1) {
  const double c = chain_sums(t, L, min(lane, L));
  const int n = lane < L && c >= tau ? count_children(t.lp + lane * t.ld, keff, c, tau) : 0;
  const int incl = warp_inclusive_scan(n, lane), d = n > 1 ? n - 1 : 0;
  const int dincl = Dealt ? warp_inclusive_scan(d, lane) : 0;
  if (lane <= L) {
    cs[lane] = c;
    if (Dealt) devs[lane] = dincl - d;
  }
  if (lane < L) {
    cnt[lane] = n;
    first[lane] = 1 + incl - n;
    x0[lane] = (double)t.lp[lane * t.ld];
    x1[lane] = keff > 1 ? (double)t.lp[lane * t.ld + 1] : -INFINITY;
  }
  if (lane == 31) *kids = incl;
}

// Device: warp 0 counts the chain's children; then warp a walks the lines of 0^a's
// deviations, a lane each, over the rows' first two log-probs staged as doubles.
__device__ int one_deviation_layout_device(const Threshold& t, int L, int keff, double tau, int tid, int nthreads) {
  if (nthreads < 32 * L) return -1;  // a warp a depth
  const int lane = tid & 31, a = tid >> 5;
  int* cnt = t.scratch + ONE_DEV_SCRATCH;  // [L] children of 0^a scoring >= tau
  int* first = cnt + KEY_DEPTH;            // [L] buffer index of 0^a's first child
  int* lines = first + KEY_DEPTH;          // [L] nodes below 0^a's deviations
  int* kids = lines + KEY_DEPTH;           // the chain nodes' children, all
  double* cs = reinterpret_cast<double*>(t.items);  // chain(0 .. L), over the sort items (free here)
  double* x0 = cs + KEY_DEPTH + 1;                  // [L] each row's rank-0 log-prob
  double* x1 = x0 + KEY_DEPTH;                      // [L] its rank-1 one (-inf for rows of one)
  if (tid < 32) one_dev_count_chain<false>(t, L, keff, tau, lane, cnt, first, kids, nullptr, cs, x0, x1);
  __syncthreads();
  const int chain_kids = *kids;
  if (1 + chain_kids > t.cap) return -1;
  const int n = a < L ? cnt[a] : 0;  // warp-uniform
  const double ca = a < L ? cs[a] : 0.0;
  // Lane r - 1 of warp a walks the line of 0^a r (32 deviations a pass).
  auto walk = [&](int r, auto&& visit) { return one_dev_walk(t, x0, x1, L, tau, a, r, ca, visit); };
  bool two = false;
  int mine = 0, below_first = 0;  // this lane's line length in the first pass (most trees hold one)
  for (int r0 = 1; r0 < n; r0 += 32) {
    const int r = r0 + lane;
    const int below = r < n ? walk(r, [](int, double, double, double) {}) : 0;
    if (r0 == 1) below_first = below;
    two |= below < 0;
    int c = below > 0 ? below : 0;
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(FULL_MASK, c, o);
    mine += c;
  }
  if (lane == 0 && a < L) lines[a] = mine;
  if (__syncthreads_or(two)) return -1;
  const int ln = lane < L ? lines[lane] : 0;
  const int incl = warp_inclusive_scan(ln, lane);
  const int total = 1 + chain_kids + __shfl_sync(FULL_MASK, incl, 31);
  if (total > t.cap) return -1;
  int at = 1 + chain_kids + __shfl_sync(FULL_MASK, incl - ln, a & 31);  // warp a's first line node
  if (tid == 0) store_root(t);
  if (tid < L && cnt[tid] > 0) {  // chain node 0^(tid + 1), 0^tid's first child
    store_child(t, tid, tid == 0 ? 0 : first[tid - 1], 0, first[tid], cs[tid], x0[tid], cs[tid + 1]);
    one_dev_tag(t, first[tid], 0, 0);
  }
  for (int r0 = 1; r0 < n; r0 += 32) {
    const int r = r0 + lane;
    const int below = r0 == 1 ? below_first : r < n ? walk(r, [](int, double, double, double) {}) : 0;
    const int end = warp_inclusive_scan(below, lane);
    const int i = at + end - below, parent = first[a] + r;
    if (r < n) one_dev_write_line(t, x0, x1, first, L, tau, a, r, ca, i, parent);
    at += __shfl_sync(FULL_MASK, end, 31);
  }
  __syncthreads();  // the nodes before their keys (written over the rows)
  return total;
}

// The same layout with the deviations dealt over all threads by their place in the chain
// counts' scan (a thread a deviation, a block scan for the lines' places), where warp a
// walks all of 0^a's deviations: at budget 256 warp 1 holds 30-54 of them.
__device__ int one_deviation_layout_dealt(const Threshold& t, int L, int keff, double tau, int tid, int nthreads) {
  const int lane = tid & 31;
  int* cnt = t.scratch + ONE_DEV_SCRATCH;  // [L] children of 0^a scoring >= tau
  int* first = cnt + KEY_DEPTH;            // [L] buffer index of 0^a's first child
  int* devs = first + KEY_DEPTH;           // [L + 1] deviations of the chain nodes before 0^a
  int* kids = devs + KEY_DEPTH + 1;        // the chain nodes' children, all
  double* cs = reinterpret_cast<double*>(t.items);
  double* x0 = cs + KEY_DEPTH + 1;
  double* x1 = x0 + KEY_DEPTH;
  if (tid < 32) one_dev_count_chain<true>(t, L, keff, tau, lane, cnt, first, kids, devs, cs, x0, x1);
  __syncthreads();
  const int chain_kids = *kids, patterns = devs[L];
  if (1 + chain_kids > t.cap) return -1;
  // Deviation p: of chain node 0^a with devs[a] <= p < devs[a + 1], rank p - devs[a] + 1.
  auto depth_of = [&](int p) {
    int lo = 0;
    for (int step = KEY_DEPTH / 2; step > 0; step >>= 1)
      if (lo + step < L && devs[lo + step] <= p) lo += step;
    return lo;
  };
  bool two = false;
  for (int p = tid; p < patterns; p += nthreads) {
    const int a = depth_of(p), r = p - devs[a] + 1;
    const int below = one_dev_walk(t, x0, x1, L, tau, a, r, cs[a], [](int, double, double, double) {});
    two |= below < 0;
    t.pos[p] = below;
  }
  if (__syncthreads_or(two)) return -1;
  const int total = 1 + chain_kids + block_exclusive_scan(t.pos, patterns, t.scratch, tid, nthreads);
  if (total > t.cap) return -1;
  if (tid == 0) store_root(t);
  if (tid < L && cnt[tid] > 0) {
    store_child(t, tid, tid == 0 ? 0 : first[tid - 1], 0, first[tid], cs[tid], x0[tid], cs[tid + 1]);
    one_dev_tag(t, first[tid], 0, 0);
  }
  for (int p = tid; p < patterns; p += nthreads) {
    const int a = depth_of(p), r = p - devs[a] + 1;
    const int i = 1 + chain_kids + t.pos[p], parent = first[a] + r;
    one_dev_write_line(t, x0, x1, first, L, tau, a, r, cs[a], i, parent);
  }
  __syncthreads();  // the nodes before their keys (written over the rows)
  return total;
}
#endif

// Host twin: the same layout, one thread; each line walked twice (counted, then written).
inline int one_deviation_layout_host(const Threshold& t, int L, int keff, double tau) {
  double cs[KEY_DEPTH + 1];
  int cnt[KEY_DEPTH], first[KEY_DEPTH];
  chain_sums_host(t, L, cs);
  int chain_kids = 0;
  for (int a = 0; a < L; ++a) {
    cnt[a] = cs[a] >= tau ? count_children(t.lp + a * t.ld, keff, cs[a], tau) : 0;
    first[a] = 1 + chain_kids;
    chain_kids += cnt[a];
  }
  if (1 + chain_kids > t.cap) return -1;
  // The line of 0^a r: its nodes below the deviation, or -1 where one has a second deviation.
  auto walk = [&](int a, int r, auto&& visit) {
    double sc = KD_DADD(cs[a], (double)t.lp[a * t.ld + r]);
    int below = 0;
    for (int j = a + 1; j < L; ++j) {
      if (keff > 1 && KD_DADD(sc, (double)t.lp[j * t.ld + 1]) >= tau) return -1;
      const double x0 = (double)t.lp[j * t.ld], next = KD_DADD(sc, x0);
      if (!(next >= tau)) break;
      visit(below, sc, x0, next);
      sc = next;
      ++below;
    }
    return below;
  };
  int lines = 0;
  for (int a = 0; a < L; ++a)
    for (int r = 1; r < cnt[a]; ++r) {
      const int below = walk(a, r, [](int, double, double, double) {});
      if (below < 0) return -1;
      lines += below;
    }
  const int total = 1 + chain_kids + lines;
  if (total > t.cap) return -1;
  store_root(t);
  for (int a = 0, at = 1 + chain_kids; a < L; ++a) {
    const int up = a == 0 ? 0 : first[a - 1];
    if (cnt[a] > 0) {
      store_child(t, a, up, 0, first[a], cs[a], (double)t.lp[a * t.ld], cs[a + 1]);
      one_dev_tag(t, first[a], 0, 0);
    }
    for (int r = 1; r < cnt[a]; ++r) {
      const double x = (double)t.lp[a * t.ld + r];
      store_child(t, a, up, r, first[a] + r, cs[a], x, KD_DADD(cs[a], x));
      one_dev_tag(t, first[a] + r, a, r);
      int parent = first[a] + r;
      walk(a, r, [&](int k, double sp, double x0, double sc) {
        store_child(t, a + 1 + k, parent, 0, at, sp, x0, sc);
        one_dev_tag(t, at, a, r);
        parent = at++;
      });
    }
  }
  return total;
}

#ifdef __CUDA_ARCH__
__device__ inline int one_deviation_layout(const Threshold& t, int L, int keff, double tau, int tid, int nthreads) {
  return keff >= ONE_DEV_DEAL_MIN ? one_deviation_layout_dealt(t, L, keff, tau, tid, nthreads)
                                 : one_deviation_layout_device(t, L, keff, tau, tid, nthreads);
}
#else
inline int one_deviation_layout(const Threshold& t, int L, int keff, double tau, int tid, int nthreads) {
  (void)tid; (void)nthreads;
  return one_deviation_layout_host(t, L, keff, tau);
}
#endif

// The batch gate's answer for a request's start bound (tree_build.cu): none, only for a deep
// tree (a batch where one request's raise sets the batch's time), or always.
enum StartBound { START_NONE = 0, START_DEEP = 1, START_ALWAYS = 2 };

// One request's selection over staged, certified rows (L <= KEY_DEPTH); start (StartBound):
// raise the first tau by deviation_bound (K < budget) or chain_bound. Writes the pops to
// out.nodes[1..n] and the links next_token/next_sibling (which must hold -1); returns n,
// or -1 where the certificate fails (the caller then runs select_nodes). stats (may be
// null) gets {raises, candidates sorted, 1 where one_deviation_layout laid the tree out}.
// WIDE: the one-CTA-an-SM kernel's program, whose registers hold more: a raise picks by
// linear bins first (raise_tau_linear; else by the radix), and a narrow level takes its few
// lead parents first (materialise_narrow). The host twin's argument picks the program.
template <bool WIDE>
KD_HD int threshold_select(const Threshold& t, int L, int K, int budget, const Selection& out,
                           int tid, int nthreads, int* stats, int start) {
  const int keff = min(budget, K);
  if (budget <= 0 || L == 0 || keff == 0) return 0;
  const int cap = t.cap;
  // tau starts at a score the best `budget` nodes all reach: the budget-th depth-1 node's,
  // or below every node when depth 1 holds fewer.
  // (The sum below every score is a chain of L dependent adds: only tiny vocabularies
  // need it.)
  double tau;
  if (keff >= budget) {
    tau = (double)t.lp[budget - 1];
  } else {
    tau = -1.0;
    for (int d = 0; d < L; ++d) tau = KD_DADD(tau, (double)t.lp[d * t.ld + keff - 1]);
  }
  // A confident drafter's deep tree (node 0^DEEP_CHAIN above tau): its top nodes lie past a
  // deviation (0^a r 0^b), which the chain bound misses, so its levels overflow; it takes
  // the one-deviation bound, also where no start bound would run, for rows of DEEP_KEFF_MIN
  // ranks or more, and not where the chain bound runs over rows wider than DEEP_KEFF_MAX
  // (past it the deviation bound cost more than the raises it saved; 64 until the
  // one-deviation layout made deep trees' levels cheap at budgets 128-256). Narrower rows
  // take the chain bound where the gate says START_DEEP (no raise left on the sweep's
  // shapes; the deviation bound cost more there).
  const bool chain_start = start == START_ALWAYS;
  const bool wide = keff >= DEEP_KEFF_MIN;
  const bool deep = KD_DEEP_GATE && L >= DEEP_CHAIN &&
                    (wide ? !chain_start || keff <= DEEP_KEFF_MAX : start == START_DEEP) &&
                    deep_chain(t, tau);
  if ((chain_start || deep) && (long long)L * keff >= budget)
    tau = keff < budget || (deep && wide) ? deviation_bound(t, L, keff, budget, tau, tid, nthreads)
                                          : chain_bound(t, L, keff, budget, tau, tid, nthreads);
  KD_PROF(14);
  // Where ties at tau alone fill the buffer, tau is guessed higher (bisection between lo, a
  // tau whose set overflowed, and hi) and the guess kept only if its set holds `budget`.
  double lo = tau, hi = (double)t.lp[0];
  double tie_tau = 0.0;  // tie: tau is next_up(tie_tau), tie_tau maybe the budget-th score
  bool guess = false, tie = false;
  int lb, le, raises = 0;
  clear_level_counters(t, tid);
  // A deep tree one deviation wide is laid out at once, any other tree level by level. Deep:
  // the gate's, or rows narrower than DEEP_KEFF_MIN whose 0^DEEP_CHAIN reaches the final tau
  // (budget 16's deep trees, which the gate leaves to the chain bound; asked once more only
  // where the gate did not ask). One-CTA kernel only: under the two-CTA kernel's 64
  // registers the layout's code spilled, and every batch-256 build paid. Not where the top-k
  // is shorter than the budget (budget 1024 over K 256): there it declined, for both
  // drafters, after walking lines of up to K deviations (1.03-1.22x the time).
  const bool one_dev = KD_ONE_DEV_LAYOUT && WIDE && keff == budget &&
                       (deep || (!wide && start != START_DEEP && L >= DEEP_CHAIN && deep_chain(t, tau)));
  le = one_dev ? one_deviation_layout(t, L, keff, tau, tid, nthreads) : -1;
  const bool laid_out = le > 0;
  if (stats && tid == 0) stats[2] = laid_out;
  while (!laid_out) {  // the levels, where the layout did not run or declined
    if (tid == 0) store_root(t);
    lb = 0;
    le = 1;
    KD_BARRIER();
    bool restart = false;
    int d = 0;
    narrow_levels<WIDE>(t, L, keff, tau, &d, &lb, &le, tid);
    KD_PROF(23);
    for (; d < L;) {
      const float* row = t.lp + d * t.ld;
      const int room = cap - le;
      const int total = materialise_level(t, row, keff, d, tau, lb, le, tid, nthreads);
      if (total > room) {  // overflow: raise tau over what is materialised, redo this level
        KD_PROF(24);
        if (++raises > TS_MAX_RAISES) return -1;
        double nt = KD_LEVEL_RAISE && total > LEVEL_RAISE_OVER * room && le - lb <= LEVEL_RAISE_MAX
                        ? level_bound(t, row, keff, budget, tau, lb, le, tid, nthreads) : tau;
        KD_PROF(32);
        if (!(nt > tau)) nt = WIDE ? raise_tau_linear(t, cap, budget, (cap - budget) / 2, tau, tid, nthreads)
                                      : raise_tau(t, cap, budget, (cap - budget) / 2, tid, nthreads);
        // A bin cut short may reach down to tau itself: then take the exact budget-th score.
        if (!(nt > tau)) nt = raise_tau(t, cap, budget, -1, tid, nthreads);
        KD_PROF(21);
        // All three level counters to zero (read by all before raise_tau's barriers): the
        // narrow levels below may skip any number of levels, and the restarts below need
        // them zero too.
        clear_level_counters(t, tid);
        if (nt > tau) {
          tau = nt;
          guess = false;
          tie = false;  // budget nodes score >= nt > tie_tau
          le = compact(t, le, tau, &lb, tid, nthreads);
          KD_PROF(22);
          // The redone level and the ones after are often narrow again (a raise keeps
          // about `budget` nodes): warp 0 takes them without block barriers.
          if (le - lb <= 32) narrow_levels<WIDE>(t, L, keff, tau, &d, &lb, &le, tid);
          continue;
        }
        if (!tie && !guess && ties_are_leaves(t, L)) {
          // Stuck on ties: enumerate S(> tau) instead. If that holds fewer than `budget`,
          // tau is the budget-th score and select_ties takes the tied nodes in path order.
          tie = true;
          tie_tau = tau;
          tau = next_up(tau);
          restart = true;
          break;
        }
        tie = false;
        lo = tau;  // stuck again: guess
        tau = lo + (hi - lo) / 2;
        if (!(tau > lo && tau < hi)) return -1;
        guess = true;
        restart = true;
        break;
      }
      if (tid == 0) t.scratch[TS_COUNTERS + (d + 2) % 3] = 0;  // level d - 1's, read by all
      if (total == 0) break;
      lb = le;
      le += total;
      ++d;
      narrow_after_wide<WIDE>(t, L, keff, tau, &d, &lb, &le, tid);
    }
    if (restart) continue;
    if (tie && le - 1 < budget) {  // tie_tau is the budget-th score
      le = select_ties(t, L, keff, tie_tau, le, budget - (le - 1), tid, nthreads);
      if (le < 0) return -1;
      tau = tie_tau;  // every candidate scores >= tau (bucket_rank's bins start there)
      break;
    }
    if (guess && le - 1 < budget) {  // the guess was too high
      if (++raises > TS_MAX_RAISES) return -1;
      KD_BARRIER();
      clear_level_counters(t, tid);
      hi = tau;
      tau = lo + (hi - lo) / 2;
      if (!(tau > lo && tau < hi)) return -1;
      continue;
    }
    break;
  }
  KD_PROF(2);
  const int nS = le, m = nS - 1;
  const int n = m < budget ? m : budget;
  if (stats && tid == 0) { stats[0] = raises; stats[1] = m; }
  // Keys (over the dead lp), then the sort of the m candidates.
  bool long_keys = false;  // a node deeper than SHORT_KEY_DEPTH: all four key words in use
  for (int i = 1 + tid; i < nS; i += nthreads) {
    if (KD_ONE_DEV_KEYS && laid_out) write_one_dev_key(t, i);
    else write_key(t, i);
    long_keys |= ts_depth(t.meta[i]) > SHORT_KEY_DEPTH;
    t.pos[i - 1] = 0;  // rank_sort's counters
  }
  long_keys = block_any(long_keys);  // and the barrier before the ranks
  KD_PROF(3);
  int popped;
  if (rank_and_emit(t, m, n, tau, !long_keys, out, tid, nthreads, &popped)) return popped;
  sort_items(t, m, tid, nthreads);
  KD_PROF(4);
  // Pop index of every selected node; refuse if a sum was inexact or a parent is missing.
  bool bad = false;
  for (int i = tid; i < nS; i += nthreads) t.pos[i] = 0;
  KD_BARRIER();
  for (int k = tid; k < n; k += nthreads) {
    t.pos[t.items[k].idx] = k + 1;
    bad |= ts_inexact(t.meta[t.items[k].idx]);
  }
  if (block_any(bad)) return -1;
  for (int k = tid; k < n; k += nthreads) {
    const int i = t.items[k].idx;
    const uint32_t mi = t.meta[i];
    const int p = ts_parent(mi), pp = p == 0 ? 0 : t.pos[p];
    bad |= p != 0 && pp == 0;
    out.nodes[k + 1] = pack_node(pp, ts_rank(mi), ts_depth(mi));
    if (ts_rank(mi) == 0) out.next_token[pp] = (int16_t)(k + 1);
    if (i + 1 < nS && ts_parent(t.meta[i + 1]) == p && t.pos[i + 1] > 0)
      out.next_sibling[k + 1] = (int16_t)t.pos[i + 1];
  }
  if (block_any(bad)) return -1;
  return n;
}

}  // namespace kd
