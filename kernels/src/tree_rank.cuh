// Ordering the candidates as the heap pops them: path keys, ranks by counting
// (rank_count, bucket_rank) and the pops from them, or the merge sort (sort_items).
#pragma once

#include "tree_levels.cuh"

namespace kd {

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

}  // namespace kd
