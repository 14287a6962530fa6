// Ties at the budget-th score: when tied leaves alone fill the buffer, the nodes above
// the tie and then the tied leaves in path order (select_ties).
#pragma once

#include "tree_bounds.cuh"

namespace kd {

// Turns node i's key (write_key's) into that of its child of rank r: the digit of
// depth(i) + 1 set.
KD_HD void to_child_key(const Threshold& t, int i, int r) {
  const int d = ts_depth(t.meta[i]);  // the child's digit index
  t.keys[(size_t)i * KEY_WORDS + (d >> 2)] |= (uint64_t)(r + 1) << ((3 - (d & 3)) * 16);
}

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

}  // namespace kd
