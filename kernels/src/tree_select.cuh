// Best-first selection of the DDTree build (spec ddtree.md sections 2-3), shared by the
// GPU kernel (one warp per request) and a host entry point that runs the same code with
// the 32 lanes in a loop, so CI checks the kernel's selection without a GPU.
//
// The frontier (what the spec's heap holds) is kept in two parts:
//   lanes:    its best k <= 32 entries, sorted, one per lane (lane 0 holds the best);
//   overflow: the rest, unordered in shared memory, each worse than every lane entry.
// A pop takes lane 0; the popped node's next sibling and first child enter the lanes by
// rank (one ballot and one shuffle each) or go to the overflow; when the lanes run dry,
// the overflow's best entries move up. Equal scores (frequent: bf16 logits) are ordered by
// rank path; for L <= 16 each popped node keeps its path as a 256-bit key (16-bit digits,
// most significant first), so a tie costs four word compares instead of a walk up the tree.
// The frontier is the heap's set after every pop and
// the order (score, then rank path) is total, so the pops are the reference's exactly,
// with no assumption that scores fall along the tree.
#pragma once
#include "common.cuh"

namespace kd {

#ifdef __CUDA_ARCH__
#define KD_DADD(a, b) __dadd_rn(a, b)
#define KD_DSUB(a, b) __dsub_rn(a, b)
#define KD_LANE0 ((threadIdx.x & 31) == 0)
#define KD_SYNCWARP() __syncwarp()
#else
#define KD_DADD(a, b) ((a) + (b))   // host double arithmetic: no contraction across calls
#define KD_DSUB(a, b) ((a) - (b))
#define KD_LANE0 true
#define KD_SYNCWARP() ((void)0)
#endif

constexpr unsigned FULL_MASK = 0xffffffffu;

// A candidate (or popped node): parent index, rank among its siblings, depth, packed in
// one word so that an entry moves as one 16-byte struct.
constexpr int PARENT_BITS = 11, RANK_BITS = 10;
constexpr int MAX_DEPTH = (1 << (32 - PARENT_BITS - RANK_BITS)) - 1;  // 2047
KD_HD uint32_t pack_node(int parent, int rank, int depth) {
  return (uint32_t)parent | ((uint32_t)rank << PARENT_BITS) | ((uint32_t)depth << (PARENT_BITS + RANK_BITS));
}
KD_HD int node_parent(uint32_t m) { return (int)(m & ((1u << PARENT_BITS) - 1)); }
KD_HD int node_rank(uint32_t m) { return (int)((m >> PARENT_BITS) & ((1u << RANK_BITS) - 1)); }
KD_HD int node_depth(uint32_t m) { return (int)(m >> (PARENT_BITS + RANK_BITS)); }

struct Entry {
  double score;
  uint32_t node;
};

constexpr int KEY_WORDS = 4, KEY_DEPTH = 16;  // path keys: 16 digits of 16 bits
// Depths whose digits lie in the keys' first two words: nodes no deeper are ordered by
// those (words 2 and 3 are zero).
constexpr int SHORT_KEY_DEPTH = 2 * (KEY_DEPTH / KEY_WORDS);

struct Selection {
  Entry* overflow;         // frontier entries beyond the lanes; never more than n + 1
  uint32_t* nodes;         // popped nodes 1..n (node 0, the root, is never read)
  uint64_t* keys;          // path keys of popped nodes [n + 1][KEY_WORDS], or null (L > 16)
  int16_t* next_token;     // left-child / right-sibling links of popped nodes
  int16_t* next_sibling;
  int16_t* last_child;
};

// Rank path of node-or-candidate a < that of b (a proper prefix is smaller).
// Lifting goes through parents of popped nodes; both reach the root within depth steps.
KD_HD bool path_less(const uint32_t* nodes, uint32_t a, uint32_t b) {
  int pa = node_parent(a), ra = node_rank(a), da = node_depth(a);
  int pb = node_parent(b), rb = node_rank(b), db = node_depth(b);
  const int da0 = da, db0 = db;
  for (; da > db; --da) { ra = node_rank(nodes[pa]); pa = node_parent(nodes[pa]); }
  for (; db > da; --db) { rb = node_rank(nodes[pb]); pb = node_parent(nodes[pb]); }
  if (pa == pb && ra == rb) return da0 < db0;  // one path is a prefix of the other
  for (; pa != pb && da > 0; --da) {
    ra = node_rank(nodes[pa]); pa = node_parent(nodes[pa]);
    rb = node_rank(nodes[pb]); pb = node_parent(nodes[pb]);
  }
  return ra < rb;
}

// Word w of the path key of node-or-candidate m: its parent's key plus its own digit.
KD_HD uint64_t key_word(const uint64_t* keys, uint32_t m, int w) {
  const int d = node_depth(m) - 1;  // digit index of m's own rank
  uint64_t k = keys[(size_t)node_parent(m) * KEY_WORDS + w];
  if ((d >> 2) == w) k |= (uint64_t)(node_rank(m) + 1) << ((3 - (d & 3)) * 16);
  return k;
}

KD_HD bool key_less(const uint64_t* keys, uint32_t a, uint32_t b) {
  for (int w = 0; w < KEY_WORDS; ++w) {
    const uint64_t ka = key_word(keys, a, w), kb = key_word(keys, b, w);
    if (ka != kb) return ka < kb;
  }
  return false;
}

KD_HD bool better(const Selection& s, const Entry& x, const Entry& y) {
  if (x.score != y.score) return x.score > y.score;
  return s.keys ? key_less(s.keys, x.node, y.node) : path_less(s.nodes, x.node, y.node);
}

// ---- the lanes: the warp primitives, each with its host loop ----------------------
struct Lanes {
#ifdef __CUDA_ARCH__
  Entry e;      // this lane's entry (meaningful for lanes < k)
#else
  Entry e[32];
#endif
  int k;        // lanes holding an entry (the same on every lane)
};

#ifdef __CUDA_ARCH__
__device__ __forceinline__ Entry shfl_entry(const Entry& x, int src) {
  Entry r;
  r.score = __shfl_sync(FULL_MASK, x.score, src);
  r.node = __shfl_sync(FULL_MASK, x.node, src);
  return r;
}
#endif

// The entry of lane j, on every lane.
#ifdef __CUDA_ARCH__
__device__ inline Entry lane_get(const Lanes& f, int j) {
  return shfl_entry(f.e, j);
}
#else
inline Entry lane_get(const Lanes& f, int j) {
  return f.e[j];
}
#endif

// Lane 0's entry := x (on the device every lane's: lanes past k are never read).
#ifdef __CUDA_ARCH__
__device__ inline void lane_set_first(Lanes& f, const Entry& x) { f.e = x; }
#else
inline void lane_set_first(Lanes& f, const Entry& x) { f.e[0] = x; }
#endif

// How many of lanes [from, k) hold an entry better than x.
#ifdef __CUDA_ARCH__
__device__ inline int count_better(const Selection& s, const Lanes& f, int from, const Entry& x) {
  const int j = threadIdx.x & 31;
  return __popc(__ballot_sync(FULL_MASK, j >= from && j < f.k && better(s, f.e, x)));
}
#else
inline int count_better(const Selection& s, const Lanes& f, int from, const Entry& x) {
  int c = 0;
  for (int j = from; j < f.k; ++j) c += better(s, f.e[j], x);
  return c;
}
#endif

// Lanes become: the old lanes without lane 0 if `drop`, with x inserted at `pos` if
// `insert`. Lanes past the new end hold junk and are never read. k is the caller's.
#ifdef __CUDA_ARCH__
__device__ inline void splice(Lanes& f, int drop, bool insert, int pos, const Entry& x) {
  const int j = threadIdx.x & 31;
  const int src = min(j + drop - (insert && j > pos ? 1 : 0), 31);
  const Entry v = shfl_entry(f.e, src);
  f.e = (insert && j == pos) ? x : v;
}
#else
inline void splice(Lanes& f, int drop, bool insert, int pos, const Entry& x) {
  Entry old[32];
  for (int j = 0; j < 32; ++j) old[j] = f.e[j];
  for (int j = 0; j < 32; ++j) {
    const int src = j + drop - (insert && j > pos ? 1 : 0);
    f.e[j] = (insert && j == pos) ? x : old[src < 31 ? src : 31];
  }
}
#endif

// Index of the best overflow entry (nov > 0), on every lane.
#ifdef __CUDA_ARCH__
__device__ inline int overflow_best(const Selection& s, int nov) {
  const int lane = threadIdx.x & 31;
  Entry b = s.overflow[0];
  int bi = 0;
  for (int i = lane; i < nov; i += 32) {
    const Entry e = s.overflow[i];
    if (better(s, e, b)) { b = e; bi = i; }
  }
  for (int off = 16; off > 0; off >>= 1) {  // butterfly: every lane ends with the best
    const Entry o = shfl_entry(b, lane ^ off);
    const int oi = __shfl_xor_sync(FULL_MASK, bi, off);
    if (better(s, o, b)) { b = o; bi = oi; }
  }
  return bi;
}
#else
inline int overflow_best(const Selection& s, int nov) {
  int bi = 0;
  for (int i = 1; i < nov; ++i)
    if (better(s, s.overflow[i], s.overflow[bi])) bi = i;
  return bi;
}
#endif
// ------------------------------------------------------------------------------------

KD_HD void overflow_append(const Selection& s, int& nov, const Entry& x) {
  if (KD_LANE0) s.overflow[nov] = x;
  ++nov;
}

// x joins the frontier: into the lanes by rank if it beats the overflow, else the overflow.
KD_HD void push(Lanes& f, const Selection& s, int& nov, const Entry& x) {
  if (f.k == 32) {
    const Entry worst = lane_get(f, 31);
    if (better(s, x, worst)) {  // x enters, the worst lane entry moves down
      overflow_append(s, nov, worst);
      splice(f, 0, true, count_better(s, f, 0, x), x);
    } else {
      overflow_append(s, nov, x);
    }
  } else if (nov == 0 || (f.k > 0 && better(s, x, lane_get(f, f.k - 1)))) {
    splice(f, 0, true, count_better(s, f, 0, x), x);
    ++f.k;
  } else {
    overflow_append(s, nov, x);
  }
}

// Lanes ran dry: move the overflow's best entries up, best first.
KD_HD void refill(Lanes& f, const Selection& s, int& nov) {
  while (f.k < 32 && nov > 0) {
    const int i = overflow_best(s, nov);
    const Entry x = s.overflow[i];
    KD_SYNCWARP();  // every lane has read slot i before lane 0 overwrites it
    if (KD_LANE0) s.overflow[i] = s.overflow[nov - 1];
    --nov;
    splice(f, 0, true, f.k, x);
    ++f.k;
    KD_SYNCWARP();
  }
}

// Log-prob of rank r at depth d; lp has row stride ld.
KD_HD double load_lp(const float* lp, int ld, int d, int r) {
  float v = lp[(size_t)d * ld + r];
  if (v == -INFINITY) v = NEG_INF_FLOOR;  // spec policy, identical to kdtree.checks
  return (double)v;
}

// The spec's best-first loop over one request; every lane of the warp calls it and gets
// the node count n. nodes[1..n] and the links are written (by lane 0).
KD_HD int select_nodes(const float* lp, int ld, int L, int K, int budget, const Selection& s) {
  const int Keff = min(budget, K);
  if (budget <= 0 || L == 0 || Keff == 0) return 0;
  Lanes f;
  f.k = 1;
  int nov = 0, n = 0;
  lane_set_first(f, Entry{load_lp(lp, ld, 0, 0), pack_node(0, 0, 1)});
  while (f.k > 0 && n < budget) {
    const Entry top = lane_get(f, 0);
    const int parent = node_parent(top.node), rank = node_rank(top.node), depth = node_depth(top.node);
    ++n;
    if (KD_LANE0) {
      s.nodes[n] = top.node;
      if (s.keys)
        for (int w = 0; w < KEY_WORDS; ++w) s.keys[(size_t)n * KEY_WORDS + w] = key_word(s.keys, top.node, w);
      const int last = s.last_child[parent];
      if (last < 0) s.next_token[parent] = (int16_t)n; else s.next_sibling[last] = (int16_t)n;
      s.last_child[parent] = (int16_t)n;
    }
    KD_SYNCWARP();  // nodes[n] and keys[n] are read by path comparisons below
    // The next sibling takes the popped entry's place (pop + push, in one splice).
    if (rank + 1 < Keff) {
      const Entry sib{KD_DADD(KD_DSUB(top.score, load_lp(lp, ld, depth - 1, rank)),
                              load_lp(lp, ld, depth - 1, rank + 1)),
                      pack_node(parent, rank + 1, depth)};
      if (nov == 0 || (f.k > 1 && better(s, sib, lane_get(f, f.k - 1)))) {
        splice(f, 1, true, count_better(s, f, 1, sib), sib);
      } else {
        splice(f, 1, false, 0, sib);
        --f.k;
        overflow_append(s, nov, sib);
      }
    } else {
      splice(f, 1, false, 0, top);
      --f.k;
    }
    if (depth < L)
      push(f, s, nov, Entry{KD_DADD(top.score, load_lp(lp, ld, depth, 0)), pack_node(n, 0, depth + 1)});
    KD_SYNCWARP();  // overflow writes are visible before a refill reads them
    if (f.k == 0 && nov > 0) refill(f, s, nov);
  }
  return n;
}

}  // namespace kd
