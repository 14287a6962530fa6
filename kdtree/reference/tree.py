"""CPU reference for DDTree: stage A, the best-first tree build and greedy accept.

This is the normative CPU builder of ``shared/spec/ddtree.md``: a heap of
``(-score, rank_path)`` tuples, exactly as the authors' reference pops them,
so exact score ties fall to the lexicographically smaller rank path (a proper
prefix first). The GPU kernel is checked against this module byte for byte.

Batched forms pad every request to one ``D`` (what CUDA graphs need). A padded
slot is an unreachable leaf of the root: parent 0, depth 1, token 0, position
``seq_len + 1``, visibility root + itself, and no next_token/next_sibling link
points to it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

from ..checks import (InputError, check_dtype, check_int, check_log_probs, check_ndim,
                     to_numpy)

MAX_BUDGET = 1024
PAD_TOKEN = 0


@dataclass(frozen=True)
class Tree:
    """One request's draft tree; slot 0 is the root (last round's bonus token)."""

    tokens: np.ndarray        # int64 [n]    token of node i+1
    depths: np.ndarray        # int64 [n]    depth 1..L of node i+1
    parents: np.ndarray       # int32 [n+1]  parents[0] == -1, parents[i] < i
    visibility: np.ndarray    # bool [n+1, n+1] ancestor closure, diagonal set
    next_token: np.ndarray    # int64 [n+1]  smallest-index child, or -1
    next_sibling: np.ndarray  # int64 [n+1]  next larger-index node with the same parent, or -1
    scores: np.ndarray        # float64 [n]  score at pop (diagnostics: pops are non-increasing)

    @property
    def n(self) -> int:
        return int(self.tokens.shape[0])

    def positions(self, seq_len: int) -> np.ndarray:
        """int64 [n+1]: ``seq_len + depth`` with the root at depth 0."""
        seq_len = check_int("seq_len", seq_len, lo=0)
        return seq_len + np.concatenate([[0], self.depths]).astype(np.int64)


# ---------------------------------------------------------------- stage A
def stage_a(logits, k: int):
    """Top-k log-probs and ids from drafter logits ``[..., L, V]`` (any float dtype).

    Cast to float32; ``log_z = logsumexp`` over the whole vocabulary; ties in
    top-k go to the lower token id (a stable descending sort), which GPU
    ``topk`` does not promise. Returns torch tensors ``(top_lp f32, top_ids i64)``.
    """
    import torch

    if not isinstance(logits, torch.Tensor):
        logits = torch.as_tensor(logits)
    if logits.dim() < 2:
        raise InputError(f"logits: expected [..., L, V], got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise InputError(f"logits: expected a floating dtype, got {logits.dtype}")
    k = check_int("k", k, lo=1)
    x = logits.float()
    if torch.isnan(x).any():
        raise InputError("logits: contains NaN")
    k = min(k, x.shape[-1])
    vals, ids = torch.sort(x, dim=-1, descending=True, stable=True)
    log_z = torch.logsumexp(x, dim=-1, keepdim=True)
    return (vals[..., :k] - log_z).contiguous(), ids[..., :k].contiguous()


# ---------------------------------------------------------------- build
def _check_stage_b(top_logprobs, top_ids, budget):
    lp = to_numpy("top_logprobs", top_logprobs)
    ids = to_numpy("top_ids", top_ids)
    check_ndim("top_logprobs", lp, 2, "[L, K]")
    check_ndim("top_ids", ids, 2, "[L, K]")
    check_dtype("top_logprobs", lp, np.float32)
    check_dtype("top_ids", ids, np.int64)
    if lp.shape != ids.shape:
        raise InputError(f"top_ids: expected the shape of top_logprobs {tuple(lp.shape)}, "
                         f"got {tuple(ids.shape)}")
    budget = check_int("budget", budget, hi=MAX_BUDGET)
    lp = check_log_probs("top_logprobs", lp)
    # Token ids are copied into the tree: a negative one is no token (checked where read).
    head_ids = ids[:, :max(0, min(budget, ids.shape[1]))]
    if head_ids.size and (head_ids < 0).any():
        at = tuple(int(i) for i in np.argwhere(head_ids < 0)[0])
        raise InputError(f"top_ids: expected token ids >= 0, got {int(head_ids[at])} at index {at}")
    return lp, ids, budget


def build_tree(top_logprobs, top_ids, budget: int) -> Tree:
    """The spec's best-first build from stage-A arrays (float32/int64 ``[L, K]``).

    ``budget <= 0`` gives the root-only tree (the spec's rule). Refused, naming the index:
    NaN or +inf log-probs and negative token ids (in the first ``min(budget, K)`` columns,
    the ones read). -inf is clamped to ``NEG_INF_FLOOR``. Rows that are not sorted descending
    or hold log-probs > 0 are outside stage A's contract (a log_softmax's top-k) but still a
    heap input: they are built by the same rule (the GPU kernel takes its exact fallback
    path for them, slower)."""
    return heap_build(*_check_stage_b(top_logprobs, top_ids, budget))


def heap_build(lp32: np.ndarray, ids: np.ndarray, budget: int) -> Tree:
    """The heapq build itself, on inputs ``build_tree`` has checked (the CPU sweep times this:
    the worker's build does not check its inputs either)."""
    L = lp32.shape[0]
    K = min(budget, lp32.shape[1])
    ranks: list[int] = []
    depths: list[int] = []
    parents: list[int] = [-1]
    scores: list[float] = []
    if budget > 0 and L > 0 and K > 0:
        lp = lp32.astype(np.float64).tolist()  # exact float32 values as Python floats
        # (-score, path, parent, depth, rank): tuple order is the spec's pop order.
        heap = [(-lp[0][0], (0,), 0, 1, 0)]
        n = 0
        while heap and n < budget:
            neg, path, parent, depth, rank = heapq.heappop(heap)
            s = -neg
            n += 1
            ranks.append(rank)
            depths.append(depth)
            parents.append(parent)
            scores.append(s)
            row = lp[depth - 1]
            if rank + 1 < K:
                sib = (s - row[rank]) + row[rank + 1]
                heapq.heappush(heap, (-sib, path[:-1] + (rank + 1,), parent, depth, rank + 1))
            if depth < L:
                heapq.heappush(heap, (-(s + lp[depth][0]), path + (0,), n, depth + 1, 0))
    parents_a = np.asarray(parents, dtype=np.int32)
    depths_a = np.asarray(depths, dtype=np.int64)
    next_token, next_sibling = links_from_parents(parents_a)
    return Tree(
        tokens=ids[depths_a - 1, np.asarray(ranks, dtype=np.int64)].astype(np.int64),
        depths=depths_a,
        parents=parents_a,
        visibility=visibility_from_parents(parents_a),
        next_token=next_token,
        next_sibling=next_sibling,
        scores=np.asarray(scores, dtype=np.float64),
    )


def visibility_from_parents(parents: np.ndarray) -> np.ndarray:
    """Row i is true at i and every ancestor of i (parents[i] < i). Small trees copy the
    parent's row (one step per node); larger ones take one vectorised step per level."""
    d = parents.shape[0]
    vis = np.zeros((d, d), dtype=bool)
    if d <= 48:
        for i, p in enumerate(parents.tolist()):
            if p >= 0:
                vis[i] = vis[p]
            vis[i, i] = True
        return vis
    up = np.where(parents < 0, 0, parents).astype(np.int64)  # the root is its own parent here
    rows = np.arange(d)
    anc = rows.copy()
    while True:
        vis[rows, anc] = True
        nxt = up[anc]
        if np.array_equal(nxt, anc):
            return vis
        anc = nxt


def links_from_parents(parents: np.ndarray):
    """Left-child / right-sibling lists (SGLang's retrive_next_token / _sibling)."""
    d = parents.shape[0]
    next_token = np.full(d, -1, dtype=np.int64)
    next_sibling = np.full(d, -1, dtype=np.int64)
    if d > 1:
        kids = np.arange(1, d)
        order = kids[np.argsort(parents[1:], kind="stable")]   # by parent, then index
        par = parents[order]
        first = np.ones(len(order), dtype=bool)
        first[1:] = par[1:] != par[:-1]
        next_token[par[first]] = order[first]
        same = ~first[1:]
        next_sibling[order[:-1][same]] = order[1:][same]
    return next_token, next_sibling


# ---------------------------------------------------------------- accept
def greedy_accept(tree: Tree, target):
    """Walk from the root while a child's token equals the target argmax of its parent.

    Returns ``(accepted, bonus)``: slot indices starting with 0, and the next root token.
    """
    t = to_numpy("target", target)
    check_ndim("target", t, 1, f"[n+1] = [{tree.n + 1}]")
    check_dtype("target", t, np.int64)
    if t.shape[0] != tree.n + 1:
        raise InputError(f"target: expected shape [{tree.n + 1}] (one per slot), got {tuple(t.shape)}")
    accepted = [0]
    cur = 0
    child = int(tree.next_token[0])
    while child != -1:
        if tree.tokens[child - 1] == t[cur]:
            cur = child
            accepted.append(cur)
            child = int(tree.next_token[cur])
        else:
            child = int(tree.next_sibling[child])
    return np.asarray(accepted, dtype=np.int64), int(t[cur])


# ---------------------------------------------------------------- batched
@dataclass(frozen=True)
class TreeBatch:
    """Trees of B requests padded to D slots (what the GPU kernel writes)."""

    node_counts: np.ndarray      # int32 [B]      n_b
    tokens: np.ndarray           # int64 [B, D]   slot 0 = root token (or PAD_TOKEN)
    depths: np.ndarray           # int64 [B, D]   root 0, padding 1
    parents: np.ndarray          # int32 [B, D]   -1 at the root, padding 0
    positions: np.ndarray        # int64 [B, D]   seq_len + depth
    next_token: np.ndarray       # int64 [B, D]
    next_sibling: np.ndarray     # int64 [B, D]
    visibility: np.ndarray       # bool  [B, D, D]
    visibility_bits: np.ndarray  # int32 [B, D, ceil(D/32)]: bit j%32 of word j//32

    @property
    def D(self) -> int:
        return int(self.tokens.shape[1])


def pack_visibility(vis: np.ndarray) -> np.ndarray:
    """bool [..., D, D] -> int32 [..., D, ceil(D/32)], little-endian bits within a word."""
    d = vis.shape[-1]
    words = (d + 31) // 32
    padded = np.zeros(vis.shape[:-1] + (words * 32,), dtype=np.uint64)
    padded[..., :d] = vis
    shifts = np.arange(32, dtype=np.uint64)
    packed = (padded.reshape(vis.shape[:-1] + (words, 32)) << shifts).sum(axis=-1)
    return packed.astype(np.uint32).view(np.int32)


def build_trees(top_logprobs, top_ids, budgets, seq_lens=None, root_tokens=None,
                d_max: int | None = None) -> TreeBatch:
    """Batched build: ``[B, L, K]`` stage-A arrays, per-request ``budgets [B]``.

    ``D = d_max`` if given, else ``max(budgets) + 1``. ``seq_lens [B]`` gives
    positions (0 if omitted); ``root_tokens [B]`` fills slot 0 of ``tokens``.
    """
    lp = to_numpy("top_logprobs", top_logprobs)
    ids = to_numpy("top_ids", top_ids)
    check_ndim("top_logprobs", lp, 3, "[B, L, K]")
    check_ndim("top_ids", ids, 3, "[B, L, K]")
    B = lp.shape[0]
    budgets = to_numpy("budgets", budgets)
    check_ndim("budgets", budgets, 1, f"[B] = [{B}]")
    if budgets.shape[0] != B:
        raise InputError(f"budgets: expected shape [{B}], got {tuple(budgets.shape)}")
    budgets = [check_int(f"budgets[{b}]", v, hi=MAX_BUDGET) for b, v in enumerate(budgets.tolist())]
    seq = _per_request("seq_lens", seq_lens, B, 0)
    roots = _per_request("root_tokens", root_tokens, B, PAD_TOKEN)
    D = max([max(b, 0) for b in budgets] + [0]) + 1 if d_max is None else check_int("d_max", d_max, lo=1)
    trees = [build_tree(lp[b], ids[b], budgets[b]) for b in range(B)]
    for b, t in enumerate(trees):
        if t.n + 1 > D:
            raise InputError(f"d_max: request {b} has {t.n + 1} slots, more than d_max={D}")
    out = _padded(B, D)
    for b, t in enumerate(trees):
        n = t.n
        out["node_counts"][b] = n
        out["tokens"][b, 0] = roots[b]
        out["tokens"][b, 1:n + 1] = t.tokens
        out["depths"][b, 1:n + 1] = t.depths
        out["parents"][b, :n + 1] = t.parents
        out["next_token"][b, :n + 1] = t.next_token
        out["next_sibling"][b, :n + 1] = t.next_sibling
        out["visibility"][b, :n + 1, :n + 1] = t.visibility
        out["positions"][b] = seq[b] + out["depths"][b]
    out["visibility_bits"] = pack_visibility(out["visibility"])
    return TreeBatch(**out)


def _per_request(name, values, B, default):
    if values is None:
        return [default] * B
    a = to_numpy(name, values)
    if a.shape != (B,):
        raise InputError(f"{name}: expected shape [{B}], got {tuple(a.shape)}")
    return [int(v) for v in a.tolist()]


def _padded(B: int, D: int) -> dict:
    vis = np.zeros((B, D, D), dtype=bool)
    vis[:, :, 0] = True
    vis[:, np.arange(D), np.arange(D)] = True
    parents = np.zeros((B, D), dtype=np.int32)
    parents[:, 0] = -1
    depths = np.ones((B, D), dtype=np.int64)
    depths[:, 0] = 0
    return dict(
        node_counts=np.zeros(B, dtype=np.int32),
        tokens=np.full((B, D), PAD_TOKEN, dtype=np.int64),
        depths=depths,
        parents=parents,
        positions=np.zeros((B, D), dtype=np.int64),
        next_token=np.full((B, D), -1, dtype=np.int64),
        next_sibling=np.full((B, D), -1, dtype=np.int64),
        visibility=vis,
        visibility_bits=None,
    )


def greedy_accept_batch(candidates, next_token, next_sibling, target, max_depth: int):
    """Batched greedy walk in the kernel's output form.

    ``candidates/next_token/next_sibling/target`` are ``[B, D]`` int64 (slot 0 the
    root). Returns ``accept_index int32 [B, max_depth+1]`` (global slot ids
    ``b*D + i``, -1 padded), ``accept_len int32 [B]`` (root excluded), ``bonus int64 [B]``.
    """
    arrs = {}
    for name, x in (("candidates", candidates), ("next_token", next_token),
                    ("next_sibling", next_sibling), ("target", target)):
        a = to_numpy(name, x)
        check_ndim(name, a, 2, "[B, D]")
        check_dtype(name, a, np.int64)
        arrs[name] = a
    B, D = arrs["candidates"].shape
    for name, a in arrs.items():
        if a.shape != (B, D):
            raise InputError(f"{name}: expected shape [{B}, {D}], got {tuple(a.shape)}")
    max_depth = check_int("max_depth", max_depth, lo=0)
    cand, nt, ns, tgt = (arrs[k] for k in ("candidates", "next_token", "next_sibling", "target"))
    accept_index = np.full((B, max_depth + 1), -1, dtype=np.int32)
    accept_len = np.zeros(B, dtype=np.int32)
    bonus = np.zeros(B, dtype=np.int64)
    for b in range(B):
        cur, k = 0, 0
        accept_index[b, 0] = b * D
        child = int(nt[b, 0])
        while child != -1 and k < max_depth:
            if cand[b, child] == tgt[b, cur]:
                cur = child
                k += 1
                accept_index[b, k] = b * D + cur
                child = int(nt[b, cur])
            else:
                child = int(ns[b, child])
        accept_len[b] = k
        bonus[b] = tgt[b, cur]
    return accept_index, accept_len, bonus


def greedy_accept_parents_batch(candidates, parents, node_counts, target, max_depth: int):
    """The greedy accept from parent indices (what ``kd_tree_accept_parents`` computes), in
    ``greedy_accept_batch``'s output form.

    Nodes are slots ``1..n`` (``n = node_counts[b]`` clamped to ``[0, D-1]``) whose parent
    lies in ``[0, i)``; from the root the walk goes to the smallest-slot child whose token
    equals the current slot's target. On a tree whose lists give children in ascending
    slot order (the build's) this is ``greedy_accept_batch``.
    """
    arrs = {}
    for name, x, dtype in (("candidates", candidates, np.int64), ("parents", parents, np.int32),
                           ("target", target, np.int64)):
        a = to_numpy(name, x)
        check_ndim(name, a, 2, "[B, D]")
        check_dtype(name, a, dtype)
        arrs[name] = a
    B, D = arrs["candidates"].shape
    for name, a in arrs.items():
        if a.shape != (B, D):
            raise InputError(f"{name}: expected shape [{B}, {D}], got {tuple(a.shape)}")
    counts = to_numpy("node_counts", node_counts)
    check_ndim("node_counts", counts, 1, f"[B] = [{B}]")
    check_dtype("node_counts", counts, np.int32)
    if counts.shape != (B,):
        raise InputError(f"node_counts: expected shape [{B}], got {tuple(counts.shape)}")
    max_depth = check_int("max_depth", max_depth, lo=0)
    cand, par, tgt = arrs["candidates"], arrs["parents"], arrs["target"]
    accept_index = np.full((B, max_depth + 1), -1, dtype=np.int32)
    accept_len = np.zeros(B, dtype=np.int32)
    bonus = np.zeros(B, dtype=np.int64)
    for b in range(B):
        n = min(max(int(counts[b]), 0), D - 1)
        first = {}   # parent -> its smallest matching child
        for i in range(1, n + 1):
            p = int(par[b, i])
            if 0 <= p < i and cand[b, i] == tgt[b, p] and p not in first:
                first[p] = i
        cur, k = 0, 0
        accept_index[b, 0] = b * D
        while k < max_depth and cur in first:
            cur = first[cur]
            k += 1
            accept_index[b, k] = b * D + cur
        accept_len[b] = k
        bonus[b] = tgt[b, cur]
    return accept_index, accept_len, bonus
