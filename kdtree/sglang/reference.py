"""SGLang's DDTree worker round on the CPU, written plainly from its formats
(spec sglang.md, section 1): the path kdtree.sglang replaces, and the yardstick its tests
and the worker-boundary sweep hold it to. Everything here runs on the host.
"""
from __future__ import annotations

import numpy as np
import torch

from ..checks import InputError, check_int
from ..reference.tree import MAX_BUDGET, build_tree


def build_ddtree_tree_from_topk(top_log_probs, top_token_ids, budget: int):
    """One request's tree as the worker's CPU builder returns it: ``(node_token_ids i64 [n],
    node_depths i64 [n], parents list[int] (n+1, parents[0] = -1), child_maps list[dict]
    (n+1, {token: child}), visibility bool [n+1, n+1], retrieve_next_token i64 [n+1],
    retrieve_next_sibling i64 [n+1])``, torch tensors on the CPU.

    ``top_log_probs f32 [L, k]``, ``top_token_ids i64 [L, k]`` (any device: copied to the
    host as the worker does); the heapq build of ddtree.md with k cut to min(budget, k).
    ``budget <= 0`` or ``L == 0``: the root alone.
    """
    lp = torch.as_tensor(top_log_probs).detach().to("cpu", torch.float32).numpy()
    ids = torch.as_tensor(top_token_ids).detach().to("cpu", torch.int64).numpy()
    budget = check_int("budget", budget, hi=MAX_BUDGET)
    if lp.ndim != 2 or ids.shape != lp.shape:
        raise InputError(f"top_log_probs, top_token_ids: expected two [L, k] arrays, got "
                         f"{tuple(lp.shape)} and {tuple(ids.shape)}")
    if budget <= 0 or lp.shape[0] == 0:
        return _root_only()
    t = build_tree(lp, ids, budget)
    parents = t.parents.tolist()
    tokens = t.tokens.tolist()
    child_maps = [dict() for _ in parents]
    for i in range(1, len(parents)):
        child_maps[parents[i]][tokens[i - 1]] = i
    return (torch.from_numpy(t.tokens.copy()), torch.from_numpy(t.depths.copy()), parents, child_maps,
            torch.from_numpy(t.visibility.copy()), torch.from_numpy(t.next_token.copy()),
            torch.from_numpy(t.next_sibling.copy()))


def _root_only():
    e = torch.empty(0, dtype=torch.int64)
    return (e, e.clone(), [-1], [{}], torch.ones(1, 1, dtype=torch.bool),
            torch.full((1,), -1, dtype=torch.int64), torch.full((1,), -1, dtype=torch.int64))


def pad_round(trees, bonus_tokens, prefix_lens, q: int):
    """Step 3: the padded verify layout of bs requests' trees (``trees``: the 7-tuples),
    as numpy arrays: ``tree_tokens i64 [bs, q]`` (slot 0 and pad slots the bonus token),
    ``positions i64 [bs, q]`` (prefix + depth; prefix in pad slots), ``retrieve_next_token``
    and ``retrieve_next_sibling`` i32 [bs, q] (-1 in pad slots), ``visibility bool
    [bs, q, q]`` (pad rows and columns false)."""
    bs = len(trees)
    bonus = [int(x) for x in np.asarray(bonus_tokens).reshape(-1)]
    prefix = [int(x) for x in np.asarray(prefix_lens).reshape(-1)]
    tokens = np.empty((bs, q), np.int64)
    positions = np.empty((bs, q), np.int64)
    nxt = np.full((bs, q), -1, np.int32)
    sib = np.full((bs, q), -1, np.int32)
    vis = np.zeros((bs, q, q), bool)
    for i, (node_tokens, depths, parents, _, visibility, rnt, rns) in enumerate(trees):
        n = len(parents) - 1
        if n + 1 > q:
            raise InputError(f"trees[{i}]: {n + 1} slots, more than the verify width q = {q}")
        tokens[i] = bonus[i]
        tokens[i, 1:n + 1] = node_tokens.numpy()
        positions[i] = prefix[i]
        positions[i, 1:n + 1] = prefix[i] + depths.numpy()
        nxt[i, :n + 1] = rnt.numpy()
        sib[i, :n + 1] = rns.numpy()
        vis[i, :n + 1, :n + 1] = visibility.numpy()
    return tokens, positions, nxt, sib, vis


def custom_mask(visibility, prefix_lens):
    """Step 4: per request a bool block ``[q, prefix + q]`` (prefix columns true, then the
    padded visibility), flattened row-major and concatenated; and ``mask_indptr i64 [bs+1]``."""
    vis = np.asarray(visibility, bool)
    bs, q, _ = vis.shape
    blocks, indptr = [], [0]
    for i, p in enumerate(int(x) for x in np.asarray(prefix_lens).reshape(-1)):
        block = np.ones((q, p + q), bool)
        block[:, p:] = vis[i]
        blocks.append(block.reshape(-1))
        indptr.append(indptr[-1] + block.size)
    return (np.concatenate(blocks) if blocks else np.zeros(0, bool)), np.asarray(indptr, np.int64)


def accept(child_maps_per_request, tree_tokens, target, q: int):
    """Step 6 with the child maps: ``accept_index i64 [bs, q]`` (global ``i * q + slot`` of
    the path from the root, -1 padded), ``commit_lens i32 [bs]``, ``next_token_ids i64
    [bs, q]`` (accepted draft tokens, then the bonus; zero padded)."""
    tgt = np.asarray(target, np.int64)
    toks = np.asarray(tree_tokens, np.int64)
    bs = tgt.shape[0]
    accept_index = np.full((bs, q), -1, np.int64)
    commit = np.zeros(bs, np.int32)
    nxt = np.zeros((bs, q), np.int64)
    for i, maps in enumerate(child_maps_per_request):
        path, cur = [0], 0
        while int(tgt[i, cur]) in maps[cur]:
            cur = maps[cur][int(tgt[i, cur])]
            path.append(cur)
        accept_index[i, :len(path)] = [i * q + s for s in path]
        commit[i] = len(path)
        nxt[i, :len(path) - 1] = toks[i, path[1:]]
        nxt[i, len(path) - 1] = tgt[i, cur]
    return accept_index, commit, nxt
