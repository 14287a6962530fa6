// A confident drafter's deep tree (the deep-tree gate, deep_chain) and its one-deviation
// layout: every node at most one deviation off the first-child chain, laid out at once.
#pragma once

#include "tree_ties.cuh"

namespace kd {


// Whether node 0^DEEP_CHAIN (L >= DEEP_CHAIN) scores about tau or above: a float sum, as it
// only picks a bound and sits on every request's path (the heap's double sums cost more).
KD_HD bool deep_chain(const Threshold& t, double tau) {
  float c = 0.0f;
  for (int d = 0; d < DEEP_CHAIN; ++d) c += t.lp[d * t.ld];
  return (double)c >= tau;
}

constexpr int ONE_DEV_SCRATCH = 64;  // scratch ints past block_exclusive_scan's and the pivot counts


// A laid-out node's deviation as a tag: (a << 16) | r for a node on 0^a r's line, 0 on the
// chain. Tags sit past the layout's doubles over the sort items (free until the sort).
KD_HD int* one_dev_tags(const Threshold& t) { return reinterpret_cast<int*>(t.items) + 128; }
static_assert((3 * KEY_DEPTH + 1) * sizeof(double) <= 128 * sizeof(int), "the tags start past the staged doubles");
static_assert((128 + TS_MIN_NODES) * sizeof(int) <= TS_MIN_NODES * sizeof(SortItem),
              "a tag a node fits over the sort items at every buffer size");
KD_HD void one_dev_tag(const Threshold& t, int i, int a, int r) {
  if (KD_ONE_DEV_KEYS) one_dev_tags(t)[i] = (a << 16) | r;
}

// Node i's key in a laid-out tree, from its depth and tag: one word that orders the tree's
// nodes as their path keys do, so the ranks compare short keys (the other words zero).
// At the first digit where a chain node 0^d and a line node differ, the chain's is 1 or
// past its end where the line's is r + 1 or 1: chain nodes come first, by depth; then lines
// by their deviation's depth a, deeper first (more leading 1s), then r, then depth (a line's
// upper node is a prefix of its lower ones).
KD_HD uint64_t one_dev_order(int depth, int a, int r) {
  return r == 0 ? (uint64_t)depth
                : (1ull << 30) | ((uint64_t)(KEY_DEPTH - a) << 24) | ((uint64_t)r << 5) | (uint64_t)depth;
}
KD_HD void write_one_dev_key(const Threshold& t, int i) {
  const int tag = one_dev_tags(t)[i];
  uint64_t* k = t.keys + (size_t)i * KEY_WORDS;
  k[0] = one_dev_order(ts_depth(t.meta[i]), tag >> 16, tag & 0xffff);
  k[1] = k[2] = k[3] = 0;
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
// rows' staged first two log-probs x0, x1 (-inf past depth L). Returns how many, or -1 where
// a node on it has a rank-1 child >= tau (a second deviation). Rank-0 log-probs are <= 0 and
// rounding is monotonic, so the line's sums never rise: those >= tau are a prefix, and a
// rank-1 child (<= its rank-0 sibling) reaches tau only where that sibling does. So every
// depth's step is taken and counted, with no test on the one before: the line's only
// dependent chain is its adds.
template <class Visit>
__device__ __forceinline__ int one_dev_walk(const Threshold& t, const double* x0, const double* x1, int L,
                                            double tau, int a, int r, double ca, Visit&& visit) {
  const double x = (double)t.lp[a * t.ld + r];
  double sc = KD_DADD(ca, x);
  visit(-1, ca, x, sc);
  bool two = false;
  int below = 0;
#pragma unroll
  for (int j = 1; j < KEY_DEPTH; ++j) {
    const double y0 = x0[j], y1 = x1[j], next = KD_DADD(sc, y0);
    const bool live = j > a && j < L;  // the line's depths (warp-uniform)
    two |= live & (KD_DADD(sc, y1) >= tau);
    if (live & (next >= tau)) {
      visit(below, sc, y0, next);
      ++below;
    }
    if (live) sc = next;
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

// The root and the chain's nodes, a thread each: node 0^(a + 1), 0^a's first child.
__device__ __forceinline__ void one_dev_store_chain(const Threshold& t, int L, const int* cnt, const int* first,
                                                    const double* cs, const double* x0, int tid) {
  if (tid == 0) store_root(t);
  if (tid < L && cnt[tid] > 0) {
    store_child(t, tid, tid == 0 ? 0 : first[tid - 1], 0, first[tid], cs[tid], x0[tid], cs[tid + 1]);
    one_dev_tag(t, first[tid], 0, 0);
  }
}

// Warp 0 of a layout, lane a for depth a: chain(a), the count of 0^a's children >= tau and the
// buffer index of the first (the chain nodes' children laid out by one warp scan), the row's
// first two log-probs as doubles, all the chain nodes' children, and for the dealt layout the
// deviations of the chain nodes before 0^a (a second scan).
template <bool Dealt>
__device__ __forceinline__ void one_dev_count_chain(const Threshold& t, int L, int keff, double tau, int lane,
                                                    int* cnt, int* first, int* kids, int* devs, double* cs,
                                                    double* x0, double* x1) {
  const double c = chain_at(t, min(lane, L));  // shared by the start bound or for the layout
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
  }
  if (lane < KEY_DEPTH) {  // the walks read every depth's pair
    x0[lane] = lane < L ? (double)t.lp[lane * t.ld] : -INFINITY;
    x1[lane] = lane < L && keff > 1 ? (double)t.lp[lane * t.ld + 1] : -INFINITY;
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
  double* x0 = cs + KEY_DEPTH + 1;                  // [KEY_DEPTH] each row's rank-0 log-prob (-inf past L)
  double* x1 = x0 + KEY_DEPTH;                      // [KEY_DEPTH] its rank-1 one (-inf for rows of one)
  KD_PROF(35);
  if (tid < 32) one_dev_count_chain<false>(t, L, keff, tau, lane, cnt, first, kids, nullptr, cs, x0, x1);
  __syncthreads();
  KD_PROF(36);
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
  KD_PROF(37);
  const int ln = lane < L ? lines[lane] : 0;
  const int incl = warp_inclusive_scan(ln, lane);
  const int total = 1 + chain_kids + __shfl_sync(FULL_MASK, incl, 31);
  if (total > t.cap) return -1;
  int at = 1 + chain_kids + __shfl_sync(FULL_MASK, incl - ln, a & 31);  // warp a's first line node
  one_dev_store_chain(t, L, cnt, first, cs, x0, tid);
  KD_PROF(38);
  for (int r0 = 1; r0 < n; r0 += 32) {
    const int r = r0 + lane;
    const int below = r0 == 1 ? below_first : r < n ? walk(r, [](int, double, double, double) {}) : 0;
    const int end = warp_inclusive_scan(below, lane);
    const int i = at + end - below, parent = first[a] + r;
    if (r < n) one_dev_write_line(t, x0, x1, first, L, tau, a, r, ca, i, parent);
    at += __shfl_sync(FULL_MASK, end, 31);
  }
  KD_PROF(39);
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
  one_dev_store_chain(t, L, cnt, first, cs, x0, tid);
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

}  // namespace kd
