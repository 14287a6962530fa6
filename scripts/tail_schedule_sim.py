"""A host model of the block scheduler on a per-request verify launch, behind verify_plan.cu's
`tail` row (docs/kernels/verify_attention.md, v25): CTAs are dispatched in grid order, each to
the first SM that frees; a CTA takes its key tiles plus a turnaround (TURNAROUND_TILES), an
empty split EMPTY_TILES. It compares, shape by shape, the uniform rule (v21/v22: every row tile
the request's count, grid (row tiles, B, splits)) with the tail rule (v25: the main row tiles
one split each, first; the last row tile its own count), under the rules' own gates or without
them. No GPU: the split rules are mirrored from kernels/src/verify_common.cuh (split_cost,
tail_split_cost) and verify_plan.cu (choose_splits, choose_tail_splits); the model has no memory
term (what the 8-main-tile gate is for).

    python3 scripts/tail_schedule_sim.py [--sms 132] [--out F.parquet] [--ungated]
"""
import argparse
import heapq

import pandas as pd

TURNAROUND_TILES, COMBINE_ROWS_A_TILE, MAX_PAST_FILL, EMPTY_TILES, ROWS, KEYS = 3, 2400, 16, 0.4, 64, 64


def cdiv(a, b):
    return -(-a // b)


def split_cost(ctas, wave, rows, tiles, s):
    return cdiv(ctas * s, wave) * (cdiv(tiles, s) + TURNAROUND_TILES) * COMBINE_ROWS_A_TILE + (s * rows if s > 1 else 0)


def tail_cost(main_ctas, tail_ctas, s, wave, main_rows, tail_rows, tiles):
    t_main = tiles + TURNAROUND_TILES
    waves = cdiv(main_ctas, wave)
    t_tail = cdiv(tiles, s) + TURNAROUND_TILES
    beside = (waves * wave - main_ctas) * (t_main // t_tail)
    rest = max(0, tail_ctas * s - beside)
    return (waves * t_main + cdiv(rest, wave) * t_tail) * COMBINE_ROWS_A_TILE + (s * tail_rows if s > 1 else 0)


def least(costs):
    """The count of least cost, ties to fewer: costs as (count, cost) pairs."""
    return min(costs, key=lambda sc: (sc[1], sc[0]))[0]


def plan_splits(B, row_tiles, R, max_tiles, wave):
    """choose_splits: (count, fill) for max_seq's tiles."""
    ctas = B * row_tiles
    cap = min(max_tiles // (1 if row_tiles <= 2 else 2), 128)
    fill = min(1 if ctas > wave else wave // ctas, cap)
    s = least([(c, split_cost(ctas, wave, B * R, max_tiles, c)) for c in range(fill, min(cap, MAX_PAST_FILL) + 1)])
    each = cdiv(max_tiles, s)
    return cdiv(max_tiles, each), fill


def schedule(durations, sms):
    """The launch's time: each duration, in order, on the SM that frees first."""
    free, end = [0.0] * sms, 0.0
    for d in durations:
        t = heapq.heappop(free) + d
        heapq.heappush(free, t)
        end = max(end, t)
    return end


def piece(tiles, count, split):
    per = cdiv(tiles, count)
    n = min(per, tiles - split * per) if split < count else 0
    return n + TURNAROUND_TILES if n > 0 else EMPTY_TILES


def uniform(B, R, tiles, max_tiles, sms):
    row_tiles = cdiv(R, ROWS)
    S, fill = plan_splits(B, row_tiles, R, max_tiles, sms)
    c = least([(s, split_cost(B * row_tiles, sms, B * R, tiles, s)) for s in range(fill, S + 1)]) if S > fill else S
    order = [piece(tiles, c, z) for z in range(S) for _ in range(B) for _ in range(row_tiles)]
    return schedule(order, sms) + (c * B * R / COMBINE_ROWS_A_TILE if c > 1 else 0)


def tail(B, R, tiles, max_tiles, sms, gated=True):
    """The tail rule's time, or None where its gates leave the uniform rule."""
    main_tiles, tail_rows = cdiv(R, ROWS) - 1, R - (cdiv(R, ROWS) - 1) * ROWS
    main_ctas = main_tiles * B
    idle = cdiv(main_ctas, sms) * sms - main_ctas
    if main_tiles < 1 or tail_rows >= ROWS or (gated and (main_tiles < 8 or idle * 6 > sms)):
        return None
    cost = lambda t, s: tail_cost(main_ctas, B, s, sms, main_ctas * ROWS, B * tail_rows, t)
    S = least([(s, cost(max_tiles, s)) for s in range(1, min(MAX_PAST_FILL, max_tiles) + 1)])
    if S < 2:
        return None
    c = least([(s, cost(tiles, s)) for s in range(1, S + 1)])
    order = [tiles + TURNAROUND_TILES] * main_ctas + [piece(tiles, c, z) for z in range(S) for _ in range(B)]
    return schedule(order, sms) + (c * B * tail_rows / COMBINE_ROWS_A_TILE if c > 1 else 0)


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--sms", type=int, default=132)
    a.add_argument("--out")
    a.add_argument("--ungated", action="store_true", help="the tail rule wherever a last row tile is part full")
    args = a.parse_args()
    rows = []
    for B in (1, 2, 4, 8, 16, 24, 32, 48, 64):
        for H in (8, 16, 32):
            for budget in (7, 8, 15, 16, 31, 32, 48, 63, 64, 100, 127, 128, 255, 256):
                R = (budget + 1) * H
                for P in (1024, 4096, 8192, 32768):
                    for table in (0, 131072):
                        tiles = cdiv(P + budget + 1, KEYS)
                        max_tiles = cdiv(table, KEYS) if table else tiles
                        t = tail(B, R, tiles, max_tiles, args.sms, gated=not args.ungated)
                        if t is None:
                            continue
                        u = uniform(B, R, tiles, max_tiles, args.sms)
                        rows.append(dict(B=B, H=H, budget=budget, P=P, table=table, uniform=u, tail=t, ratio=t / u))
    df = pd.DataFrame(rows)
    print(f"{len(df)} shapes take the tail rule; its time over the uniform rule's: "
          f"min {df.ratio.min():.3f}, median {df.ratio.median():.3f}, max {df.ratio.max():.3f}")
    print(df.sort_values("ratio").iloc[[0, len(df) // 2, -1]].to_string(index=False))
    if args.out:
        df.to_parquet(args.out, index=False)


if __name__ == "__main__":
    main()
