"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's warp-state sampling.

Two modes. `launch B:budget:K [--drafts confident]` builds trees on the tree-build sweep's
inputs (stage_a_inputs, L 15, V 8192, its seeds) four times, for ncu to capture one launch;
`summary FILE` reads ncu's source page exported as CSV and prints the stall reasons' shares of
all samples and the instructions that hold most samples of one reason (offsets from the
kernel's first instruction). On the H200 (docs/kernels/tree_build.md, session 31; the
library's build carries line info):

    ncu --clock-control none -k regex:build_trees --launch-skip 3 --launch-count 1 --section WarpStateStats --section SourceCounters --warp-sampling-interval 0 -o tb python3 scripts/ncu_stalls.py launch 128:64:64
    ncu -i tb.ncu-rep --page source --csv --print-source sass > tb.csv
    python3 scripts/ncu_stalls.py summary tb.csv --reason no_inst

`sources FILE` reads the same page exported with `--print-source cuda,sass` (a section a
source file, each line followed by its SASS) and gives each instruction's samples to the first
source line that lists it: shares and leading reasons by file, the hottest lines, and with
`--span file:A-B[,C-D]` the sum over a named stretch of lines (a phase).
"""
import argparse
import csv
import sys


def launch(shape: str, drafts: str) -> None:
    import torch

    from kdtree import ops
    from kdtree.harness.sweeps.tree_build import reference_inputs
    from kdtree.harness.workloads import DRAFTS

    if drafts not in DRAFTS:
        raise SystemExit(f"--drafts: expected one of {DRAFTS}, got {drafts!r}")
    B, budget, K = (int(x) for x in shape.split(":"))
    lp, ids = reference_inputs(B, budget, K, drafts)
    lp, ids = lp.cuda(), ids.cuda()
    budgets = torch.full((B,), budget, dtype=torch.int32, device="cuda")
    out = ops.tree_build(lp, ids, budgets, d_max=budget + 1)
    for _ in range(3):
        out = ops.tree_build(lp, ids, budgets, d_max=budget + 1, out=out)
    torch.cuda.synchronize()


def stall_columns(header) -> list[str]:
    """The stall-reason columns of a source page (all samples, not the not-issued copies)."""
    return [c for c in header if c.startswith("stall_") and "Not Issued" not in c]


def read_lines(path: str) -> list[str]:
    try:
        with open(path, newline="") as f:
            return f.read().splitlines()
    except OSError as e:
        raise SystemExit(f"csv: cannot read {path}: {e.strerror}")


def read_source_csv(path: str) -> list[dict]:
    """Rows of ncu's source-page CSV: its first line names the kernel, the second the columns."""
    lines = read_lines(path)
    start = next((i for i, line in enumerate(lines) if line.startswith('"Address"')), None)
    if start is None:
        raise SystemExit(f"{path}: no '\"Address\",...' header line: expected `ncu --page source --csv` output")
    return list(csv.DictReader(lines[start:]))


def number(text: str) -> float:
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return 0.0


def summary(path: str, reason: str, top: int) -> None:
    rows = read_source_csv(path)
    if not rows:
        raise SystemExit(f"{path}: a header but no instruction rows")
    reasons = stall_columns(rows[0])
    if f"stall_{reason}" not in reasons:
        raise SystemExit(f"--reason: expected one of {[r[6:] for r in reasons]}, got {reason!r}")
    totals = {r: sum(number(row[r]) for row in rows) for r in reasons}
    samples = sum(number(row.get("# Samples", 0)) for row in rows) or 1.0
    print(f"{path}: {len(rows)} instructions, {samples:.0f} samples")
    for r, v in sorted(totals.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {r[6:]:16s} {v:7.0f}  {v / samples:6.1%}")
    base = min(int(row["Address"], 16) for row in rows)
    key = f"stall_{reason}"
    hot = sorted(rows, key=lambda row: -number(row[key]))[:top]
    held = sum(number(row[key]) for row in hot)
    print(f"top {top} instructions by {reason}: {held:.0f} of {totals[key]:.0f} samples")
    for row in sorted(hot, key=lambda row: int(row["Address"], 16)):
        print(f"  +{int(row['Address'], 16) - base:#07x} {number(row[key]):6.0f}  executed "
              f"{number(row.get('Instructions Executed', 0)):8.0f}  {row['Source'].strip()}")


def read_sources_csv(path: str) -> tuple[list[str], dict[str, tuple[dict, str, int]]]:
    """The stall columns and, for each SASS address, its row and the (file, line) it is first
    listed under, from a `--print-source cuda,sass` export."""
    lines = read_lines(path)
    header, where, rows = None, None, {}
    for text in lines:
        if text.startswith('"File Path"'):
            where = (next(csv.reader([text]))[1].rsplit("/", 1)[-1], 0)
            continue
        if text.startswith('"Line No"'):
            header = next(csv.reader([text]))
            continue
        if header is None or where is None or text.startswith('"Function Name"'):
            continue
        row = next(csv.reader([text]))
        if row[0]:
            where = (where[0], int(number(row[0])))
        elif len(row) > 2 and row[2] not in ("", "-") and row[2] not in rows:
            rows[row[2]] = (dict(zip(header[2:], row[2:])), where[0], where[1])
    if header is None or not rows:
        raise SystemExit(f"{path}: no '\"Line No\",...' sections with instructions: expected "
                         "`ncu --page source --csv --print-source cuda,sass` output")
    return stall_columns(header), rows


def parse_span(text: str) -> tuple[str, list[tuple[int, int]]]:
    name, _, ranges = text.partition(":")
    try:
        spans = [tuple(int(x) for x in r.split("-")) for r in ranges.split(",")]
        if not name or any(len(r) != 2 or r[0] > r[1] for r in spans):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--span: expected file:A-B[,C-D] (e.g. tree_build.cu:44-50,205-270), got {text!r}")
    return name, spans


def sources(path: str, top: int, spans: list[str]) -> None:
    named = [(text, *parse_span(text)) for text in spans]  # checked before the file is read
    reasons, rows = read_sources_csv(path)

    def weight(picked: list[dict]) -> float:
        return sum(number(r.get("Warp Stall Sampling (All Samples)", 0)) for r in picked)

    total = weight([r for r, _, _ in rows.values()]) or 1.0
    print(f"{path}: {len(rows)} instructions, {total:.0f} samples")

    def line(name: str, picked: list[dict]) -> None:
        n = weight(picked)
        by = sorted(((sum(number(r[c]) for r in picked), c[6:]) for c in reasons), reverse=True)[:3]
        lead = ", ".join(f"{k} {v / n:.0%}" for v, k in by if v >= 0.005 * n) if n else ""
        print(f"  {name:28s} {n:7.0f}  {n / total:6.1%}  {lead}")

    print("by source file:")
    files = {}
    for r, f, _ in rows.values():
        files.setdefault(f, []).append(r)
    for f, picked in sorted(files.items(), key=lambda kv: -weight(kv[1])):
        if weight(picked):
            line(f, picked)
    for text, name, ranges in named:
        picked = [r for r, f, ln in rows.values() if f == name and any(a <= ln <= b for a, b in ranges)]
        line(text, picked)
    print(f"top {top} source lines:")
    by_line = {}
    for r, f, ln in rows.values():
        by_line.setdefault(f"{f}:{ln}", []).append(r)
    for key, picked in sorted(by_line.items(), key=lambda kv: -weight(kv[1]))[:top]:
        line(key, picked)


def main(argv=None) -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = a.add_subparsers(dest="mode", required=True)
    la = sub.add_parser("launch", help="build trees for ncu to capture (needs a GPU)")
    la.add_argument("shape", help="batch:budget:K")
    la.add_argument("--drafts", default="mixed", help="the synthetic drafter (workloads.DRAFTS)")
    su = sub.add_parser("summary", help="stall shares and hot instructions of an ncu source CSV")
    su.add_argument("csv")
    su.add_argument("--reason", default="no_inst", help="the stall reason to rank instructions by")
    su.add_argument("--top", type=int, default=20)
    so = sub.add_parser("sources", help="stall shares by source file and line of a cuda,sass source CSV")
    so.add_argument("csv")
    so.add_argument("--top", type=int, default=20)
    so.add_argument("--span", action="append", default=[], help="file:A-B[,C-D]: a stretch of lines summed")
    args = a.parse_args(argv)
    if args.mode == "launch":
        launch(args.shape, args.drafts)
    elif args.mode == "sources":
        sources(args.csv, args.top, args.span)
    else:
        summary(args.csv, args.reason, args.top)


if __name__ == "__main__":
    main(sys.argv[1:])
