// Enumerating S(tau) level by level: writing a node, a block level (materialise_level) and
// warp 0's narrow levels (materialise_narrow, narrow_levels), with host twins.
#pragma once

#include "tree_raise.cuh"

namespace kd {

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

}  // namespace kd
