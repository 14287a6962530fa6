"""Tree selection by threshold: the parallel form of the best-first build, in plain Python as
the reference of the GPU kernel's selection (kernels/src/tree_threshold.cuh; docs/kernels/tree_build.md).
The kernel finds tau differently (it raises tau from the nodes it has materialised instead of
restarting a bisection), which the proof below does not depend on.

Certificate: per depth, the first Keff log-probs are non-increasing and <= 0 (after the -inf
clamp), and every selected node's score ``parent + lp`` is exact in float64 (TwoSum error 0).
Then the heap's scores are ``fl(parent + lp[r])`` for every node it pops or holds, they never
rise along the tree (child <= parent, sibling <= elder sibling), so the heap pops exactly the
``budget`` best nodes in (score, rank path) order. Selection therefore needs no heap:

1. enumerate S(tau) = {nodes with score >= tau} level by level; a parent's children in it are
   a prefix of ranks (on a GPU: one binary search per parent, one scan per level);
2. sort S(tau) by (-score, path) and keep the first ``budget``.

tau is found by bisection on the score until ``budget <= |S(tau)| <= cap``; ``probes`` counts
the enumerations, which is the cost a GPU version has to keep small. Where the certificate
fails, or ties make every bracket overflow the cap, the result is None and the caller builds
with the heap (always exact).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..checks import InputError, check_dtype, check_int, check_log_probs, check_ndim, to_numpy
from .tree import MAX_BUDGET


@dataclass
class ThresholdSelection:
    parents: np.ndarray   # int32 [n + 1], pop-order index of each node's parent, -1 at the root
    depths: np.ndarray    # int64 [n]
    ranks: np.ndarray     # int64 [n]
    probes: int           # enumerations of S(tau) run
    candidates: int       # |S(tau)| that was sorted


class _Node(NamedTuple):
    score: float
    path: tuple      # ranks from the root: the tie order
    parent: int      # id of the parent node in the enumeration, -1 for the root
    depth: int
    rank: int
    exact: bool      # parent score + lp was exact in float64


def _exact_sum(a: float, b: float) -> bool:
    """True where a + b is exact in float64 (TwoSum error term is zero)."""
    s = a + b
    bb = s - a
    return (a - (s - bb)) + (b - bb) == 0.0


def _enumerate(lp: np.ndarray, tau: float, cap: int):
    """Nodes with score >= tau, parents first; None as soon as there are more than `cap`."""
    nodes: list[_Node] = []
    level = [(-1, 0.0, ())]  # (node id, score, path) of the previous level; the root first
    for d in range(lp.shape[0]):
        row = lp[d]
        nxt = []
        for pid, s, path in level:
            sc = s + row                              # fl(s + lp[r]), non-increasing in r
            for r in range(int(np.count_nonzero(sc >= tau))):
                nodes.append(_Node(float(sc[r]), path + (r,), pid, d + 1, r, _exact_sum(s, float(row[r]))))
                nxt.append((len(nodes) - 1, float(sc[r]), path + (r,)))
                if len(nodes) > cap:
                    return None
        if not nxt:
            break
        level = nxt
    return nodes


def select_by_threshold(top_logprobs, budget: int, cap_factor: int = 2) -> ThresholdSelection | None:
    """The heap build's selection (parents, depths, ranks in pop order), or None where the
    certificate does not hold. ``cap_factor * budget`` bounds the set that gets sorted."""
    lp32 = to_numpy("top_logprobs", top_logprobs)
    check_ndim("top_logprobs", lp32, 2, "[L, K]")
    check_dtype("top_logprobs", lp32, np.float32)
    lp32 = check_log_probs("top_logprobs", lp32)
    budget = check_int("budget", budget, hi=MAX_BUDGET)
    if cap_factor < 1:
        raise InputError(f"cap_factor: expected an integer >= 1, got {cap_factor!r}")
    L, K = lp32.shape
    keff = min(budget, K)
    if budget <= 0 or L == 0 or keff == 0:
        return ThresholdSelection(np.array([-1], np.int32), np.zeros(0, np.int64),
                                  np.zeros(0, np.int64), 0, 0)
    lp = lp32[:, :keff].astype(np.float64)
    if (lp[:, 0] > 0).any() or (np.diff(lp, axis=1) > 0).any():
        return None
    cap = max(cap_factor * budget, budget + 1)
    # Bracket: S(lo) holds >= budget nodes (or the whole tree), S(hi) the best node. The
    # depth-1 nodes of rank < budget are `budget` nodes scoring >= lp[0, budget-1], so the
    # budget-th best score lies in [lp[0, budget-1], lp[0, 0]] when K >= budget.
    whole = float(lp[:, -1].sum()) - 1.0       # below every score: S(whole) is the whole tree
    lo = float(lp[0, budget - 1]) if keff >= budget else whole
    hi = float(lp[0, 0])
    tau, probes = lo, 0
    while True:
        probes += 1
        nodes = _enumerate(lp, tau, cap)
        if nodes is not None and (len(nodes) >= budget or tau == whole):
            break                              # in range, or the tree is smaller than the budget
        if nodes is None:
            lo = tau                           # too many: raise tau
        else:
            hi = tau                           # too few: lower tau
        nxt = lo + (hi - lo) / 2
        if nxt in (lo, hi):
            return None                        # ties defeat the bracket: the heap decides
        tau = nxt
    order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].path))[:budget]
    if not all(nodes[i].exact for i in order):
        return None
    pop = {-1: 0} | {i: k + 1 for k, i in enumerate(order)}   # enumeration id -> pop index
    if any(nodes[i].parent not in pop for i in order):
        return None                            # not a downset: cannot happen when certified
    return ThresholdSelection(np.array([-1] + [pop[nodes[i].parent] for i in order], dtype=np.int32),
                              np.array([nodes[i].depth for i in order], dtype=np.int64),
                              np.array([nodes[i].rank for i in order], dtype=np.int64),
                              probes, len(nodes))
