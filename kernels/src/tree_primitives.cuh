// The threshold selection's arithmetic and block primitives: directed rounding, a parent's
// children above tau, scores as ordered keys, shared-memory atomics, warp and block scans,
// the radix pick; each a device function and its host twin where the two differ.
#pragma once
#include <string.h>

#include "tree_heuristics.cuh"

namespace kd {

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

#ifdef __CUDA_ARCH__
// A float at a 32-bit shared-memory address (smem_addr): a search that steps such an address
// costs an add a step, not a 64-bit index's conversions.
__device__ __forceinline__ float shared_f32(uint32_t a) {
  float v;
  asm("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(a));
  return v;
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
// A warp's inclusive scan of c over its lanes in order (counts, or a double's sums).
template <class T>
__device__ __forceinline__ T warp_inclusive_scan(T c, int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const T y = __shfl_up_sync(FULL_MASK, c, o);
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

#ifdef __CUDA_ARCH__
__device__ inline bool block_any(bool x) {
  return __syncthreads_or(x) != 0;
}
#else
inline bool block_any(bool x) {
  return x;
}
#endif

}  // namespace kd
