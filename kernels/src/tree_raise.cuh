// Raising tau when a level overflows the node buffer: the budget-th best score of what was
// materialised, by radix passes or linear bins (raise_tau, raise_tau_linear), and the
// compaction that drops the nodes below the new tau.
#pragma once

#include "tree_primitives.cuh"

namespace kd {

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

}  // namespace kd
