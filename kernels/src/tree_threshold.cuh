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
//     the first-child chain is laid out at once instead (one-CTA kernel, which also stops
//     the walk at the tree's depth: the largest d with chain(d) >= tau);
//  2. a level that overflows the node buffer raises tau to about the budget-th best score
//     of what was materialised (linear score bins or radix passes over the score bits; the
//     budget-th best of any subset of the tree is <= the tree's own), drops what fell
//     below, and is redone;
//  3. path keys (a walk up each node, or from a laid-out node's deviation), a sort by
//     (score, key) (device: ranks by counting up to RANK_COUNT_MAX candidates, by counting
//     within linear score bins above, merged warp-sorted runs where a bin is too tied;
//     host: a bitonic network), keep `budget`.
// A refusal returns -1 and the caller runs the heap-exact warp loop (tree_select.cuh).
// Its parts, a concern a file, each including the one before: tree_views.cuh (state),
// tree_heuristics.cuh (every dispatch rule of the build, one table), tree_primitives.cuh,
// tree_raise.cuh (2), tree_levels.cuh (1), tree_rank.cuh (3), tree_bounds.cuh (first tau),
// tree_ties.cuh, tree_one_dev.cuh (the deep-tree layout).
// Every function is called by all threads of the block with uniform control flow around
// barriers; the host build runs the same code with one thread (barriers are no-ops). Where
// the two differ, a device function and its host twin of the same name (or a dispatcher to
// `_device` and `_host` twins); the device's own schedules (warp 0's narrow levels, the
// counting ranks) have host twins that do nothing, so the host takes the general path.
#pragma once

#include "tree_one_dev.cuh"

namespace kd {


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
  KD_PROF(33);
  const bool bound = (chain_start || deep) && (long long)L * keff >= budget;
  // A start bound shares chain(0 .. L), unless the block is too small for its pivots (both
  // need at most 32 * START_PIVOTS threads); the one-deviation layout reads them. (Shared
  // here for both instead, the two-CTA kernel spilled more: tree_build.md, tried.)
  const bool chain_shared = bound && nthreads >= 32 * START_PIVOTS;
  if (bound)
    tau = keff < budget || (deep && wide) ? deviation_bound<WIDE>(t, L, keff, budget, tau, tid, nthreads)
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
  if (one_dev && !chain_shared) share_chain_for_layout(t, L, tid);
  le = one_dev ? one_deviation_layout(t, L, keff, tau, tid, nthreads) : -1;
  const bool laid_out = le > 0;
  if (stats && tid == 0) stats[2] = laid_out;
  // The walk ends at the tree's depth at this tau, which later raises only lower (one-CTA
  // kernel only: the two-CTA kernel spilled more with it).
  if (WIDE && !laid_out) share_tree_depth(t, L, tau, chain_shared || one_dev, tid);
  while (!laid_out) {  // the levels, where the layout did not run or declined
    if (tid == 0) store_root(t);
    lb = 0;
    le = 1;
    KD_BARRIER();
    const int depth = WIDE ? t.scratch[TS_DEPTH] : L;
    bool restart = false;
    int d = 0;
    narrow_levels<WIDE>(t, depth, keff, tau, &d, &lb, &le, tid);
    KD_PROF(23);
    for (; d < depth;) {
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
          if (le - lb <= 32) narrow_levels<WIDE>(t, depth, keff, tau, &d, &lb, &le, tid);
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
      narrow_after_wide<WIDE>(t, depth, keff, tau, &d, &lb, &le, tid);
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
    if (KD_ONE_DEV_KEYS && laid_out) {
      write_one_dev_key(t, i);  // one word at any depth
    } else {
      write_key(t, i);
      long_keys |= ts_depth(t.meta[i]) > SHORT_KEY_DEPTH;
    }
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
