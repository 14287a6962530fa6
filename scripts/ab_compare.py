"""Per-point new/old ratios of a scripts/ab.sh run (medians over its two repetitions)."""
import sys
from pathlib import Path

import pandas as pd

KEYS = {"tree-build": ["batch", "budget", "impl", "metric"],
        "tree-accept": ["batch", "D", "impl", "metric"],
        "verify-attn": ["heads", "D", "prefix", "batch", "page_size", "impl"]}


def side(folder: Path, v: str, sweep: str) -> pd.Series:
    d = pd.concat(pd.read_parquet(f) for f in sorted(folder.glob(f"{v}_{sweep}_*.parquet")))
    d = d[(d.status == "ok") & ~d.impl.str.startswith("cpu")]
    return d.groupby(KEYS[sweep])["median_us"].median()


def main(folder: str) -> None:
    pd.set_option("display.width", 200)
    pd.set_option("display.max_rows", 500)
    for sweep in KEYS:
        m = pd.concat({"old_us": side(Path(folder), "old", sweep), "new_us": side(Path(folder), "new", sweep)},
                      axis=1).dropna()
        m["new/old"] = m.new_us / m.old_us
        print(f"## {sweep}\n{m.round(3).to_string()}\n")
        by = [k for k in ("impl", "metric") if k in m.index.names]
        print(m.groupby(level=by)["new/old"].describe()[["count", "min", "50%", "max"]].round(3).to_string(), "\n")


if __name__ == "__main__":
    main(sys.argv[1])
