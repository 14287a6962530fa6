"""Per-point time ratios of a scripts/ab.sh run: every side against BASE, a point's time the
median over the rounds (GPU rows only; CPU baselines vary with the host, not the build); then
each round's median ratio, sides against BASE in the same round (how far rounds agree is the
run's noise).

    python3 scripts/ab_compare.py OUT [BASE]

BASE defaults to the first side ab.sh was given (OUT/sides.txt), else `old` (the earlier
two-sided form's files, old_* and new_*).
"""
import re
import sys
from pathlib import Path

import pandas as pd

KEYS = {"tree-build": ["batch", "budget", "impl", "metric", "drafts"],
        "tree-accept": ["batch", "D", "impl", "metric", "follow"],
        "verify-attn": ["heads", "D", "prefix", "batch", "page_size", "impl"]}
FILE = re.compile(r"^(?P<side>[A-Za-z0-9.-]+)_(?P<sweep>[a-z-]+)_(?P<rep>\d+)\.parquet$")


def runs(folder: Path) -> dict:
    """{sweep: {side: [files]}} of the folder's Parquet files."""
    found = {}
    for f in sorted(folder.glob("*.parquet")):
        m = FILE.match(f.name)
        if m and m["sweep"] in KEYS:
            found.setdefault(m["sweep"], {}).setdefault(m["side"], []).append(f)
    return found


def side_times(files: list, sweep: str) -> pd.Series:
    d = pd.concat(pd.read_parquet(f) for f in files)
    d = d[(d.status == "ok") & ~d.impl.str.startswith("cpu")]
    keys = [k for k in KEYS[sweep] if k in d.columns]
    return d.groupby(keys)["median_us"].median()


def main(folder: str, base: str | None = None) -> None:
    folder = Path(folder)
    found = runs(folder)
    if not found:
        sys.exit(f"ab_compare: no <side>_<sweep>_<round>.parquet files in {folder}")
    if base is None:
        listed = folder / "sides.txt"
        base = listed.read_text().split()[0] if listed.exists() else "old"
    pd.set_option("display.width", 200)
    pd.set_option("display.max_rows", 500)
    for sweep, sides in found.items():
        if base not in sides:
            print(f"## {sweep}: no rows of the base side {base!r} (sides: {', '.join(sides)})\n")
            continue
        times = pd.concat({s: side_times(files, sweep) for s, files in sides.items()}, axis=1).dropna()
        if times.empty:
            print(f"## {sweep}: no GPU point that every side measured\n")
            continue
        others = [s for s in sides if s != base]
        table = times[[base, *others]].rename(columns=lambda s: f"{s}_us")
        for s in others:
            table[f"{s}/{base}"] = times[s] / times[base]
        print(f"## {sweep}\n{table.round(3).to_string()}\n")
        by = [k for k in ("impl", "metric") if k in table.index.names]
        ratios = table[[f"{s}/{base}" for s in others]]
        for col in ratios:
            summary = ratios[col].groupby(level=by).describe()[["count", "min", "50%", "max"]]
            print(f"{col}:\n{summary.round(3).to_string()}\n")
        rounds = {s: {FILE.match(f.name)["rep"]: side_times([f], sweep) for f in files} for s, files in sides.items()}
        for s in others:
            each = [f"round {r}: {(rounds[s][r] / rounds[base][r]).dropna().median():.3f}"
                    for r in sorted(rounds[s], key=int) if r in rounds[base]]
            print(f"{s}/{base} by round (median over points): {', '.join(each)}\n")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(*sys.argv[1:])
