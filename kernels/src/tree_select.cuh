// Heap selection of the DDTree build (spec ddtree.md sections 2-3), shared by the
// GPU kernel (one thread runs it over shared memory) and a host entry point that
// lets CI check the very same code on a machine without a GPU.
#pragma once
#include "common.cuh"

namespace kd {

#ifdef __CUDA_ARCH__
#define KD_DADD(a, b) __dadd_rn(a, b)
#define KD_DSUB(a, b) __dsub_rn(a, b)
#else
#define KD_DADD(a, b) ((a) + (b))   // host double arithmetic: no contraction across calls
#define KD_DSUB(a, b) ((a) - (b))
#endif

// A candidate (or popped node): parent index, rank among its siblings, depth,
// packed in one word so that heap entries move as one 16-byte struct.
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

struct Selection {
  Entry* heap;             // binary heap, best on top; never more than n + 1 entries
  uint32_t* nodes;         // popped nodes 1..n (node 0, the root, is never read)
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

KD_HD bool better(const uint32_t* nodes, const Entry& x, const Entry& y) {
  if (x.score != y.score) return x.score > y.score;
  return path_less(nodes, x.node, y.node);
}

KD_HD void sift_down(const Selection& s, int size) {
  Entry* h = s.heap;
  const Entry top = h[0];
  int i = 0;
  while (true) {
    const int l = 2 * i + 1, r = l + 1;
    if (l >= size) break;
    const int c = (r < size && better(s.nodes, h[r], h[l])) ? r : l;
    if (!better(s.nodes, h[c], top)) break;
    h[i] = h[c];
    i = c;
  }
  h[i] = top;
}

KD_HD void sift_up(const Selection& s, int i) {
  Entry* h = s.heap;
  const Entry e = h[i];
  while (i > 0) {
    const int p = (i - 1) / 2;
    if (!better(s.nodes, e, h[p])) break;
    h[i] = h[p];
    i = p;
  }
  h[i] = e;
}

KD_HD double load_lp(const float* lp, int K, int d, int r) {
  float v = lp[(size_t)d * K + r];
  if (v == -INFINITY) v = NEG_INF_FLOOR;  // spec policy, identical to kdtree.checks
  return (double)v;
}

// The spec's heap loop; returns the node count n. nodes[1..n] and the links are written.
KD_HD int select_nodes(const float* lp, int L, int K, int budget, const Selection& s) {
  const int Keff = min(budget, K);
  if (budget <= 0 || L == 0 || Keff == 0) return 0;
  Entry* h = s.heap;
  int size = 1, n = 0;
  h[0].score = load_lp(lp, K, 0, 0);
  h[0].node = pack_node(0, 0, 1);
  while (size > 0 && n < budget) {
    const Entry top = h[0];
    const int parent = node_parent(top.node), rank = node_rank(top.node), depth = node_depth(top.node);
    ++n;
#ifdef KD_TRACE
    printf("pop n=%d parent=%d rank=%d depth=%d s=%.17g size=%d\n", n, parent, rank, depth, top.score, size);
#endif
    s.nodes[n] = top.node;
    const int last = s.last_child[parent];
    if (last < 0) s.next_token[parent] = (int16_t)n; else s.next_sibling[last] = (int16_t)n;
    s.last_child[parent] = (int16_t)n;
    // The next sibling replaces the popped top (the same heap content as pop + push:
    // the order is total, so the pop sequence is the reference's).
    if (rank + 1 < Keff) {
      h[0].score = KD_DADD(KD_DSUB(top.score, load_lp(lp, K, depth - 1, rank)),
                           load_lp(lp, K, depth - 1, rank + 1));
      h[0].node = pack_node(parent, rank + 1, depth);
    } else {
      --size;
      h[0] = h[size];
    }
    if (size > 1) sift_down(s, size);
    if (depth < L) {
      h[size].score = KD_DADD(top.score, load_lp(lp, K, depth, 0));
      h[size].node = pack_node(n, 0, depth + 1);
      sift_up(s, size);
      ++size;
    }
  }
  return n;
}

}  // namespace kd
