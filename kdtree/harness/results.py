"""Parquet results: atomic writes and resumable sweeps.

A sweep appends finished rows to a partial file next to its output after every
point (atomically), so an interrupted run resumes where it stopped; the final
Parquet appears only once, by rename, when the sweep is complete.
"""
from __future__ import annotations

import os
import pathlib
import tempfile

import pandas as pd

from .timing import ALTERNATING


def ok_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The measured rows of a sweep (failed and skipped points are rows too)."""
    return df[df["status"] == "ok"] if "status" in df else df


def read_ok_rows(path) -> pd.DataFrame | None:
    """ok_rows of a Parquet file, or None where the file does not exist."""
    path = pathlib.Path(path)
    return ok_rows(pd.read_parquet(path)) if path.exists() else None


def check_output(path, make_parent: bool = False) -> None:
    """Refuse an output file that cannot be written, before any work: a folder, a parent
    that is missing (made where make_parent) or not a folder, or one this user cannot
    write. Raises ValueError naming `out`."""
    path = pathlib.Path(path)
    parent = path.parent
    if path.is_dir():
        raise ValueError(f"out: {path} is a folder; expected a file path")
    check_folder(parent, "out", make=make_parent, what=f"folder {parent}")


def check_folder(folder, name: str, make: bool = False, what: str | None = None) -> None:
    """A folder that exists (made first where `make`) and this user can write in;
    ValueError naming `name` otherwise (`what`: how the message calls a missing one)."""
    folder = pathlib.Path(folder)
    what = what or str(folder)
    if make and not folder.exists():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"{name}: cannot make folder {folder}: {e.strerror or e}") from None
    if not folder.exists():
        raise ValueError(f"{name}: {what} does not exist")
    if not folder.is_dir():
        raise ValueError(f"{name}: {folder} is not a folder")
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".kdtree.", suffix=".check")
    except OSError as e:
        raise ValueError(f"{name}: cannot write in {folder}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(tmp)


def write_atomic(path, write) -> None:
    """write(tmp_path) into a temporary file beside `path`, then one rename: a reader sees
    the old file or the whole new one. Mode 0644, as the committed results have (mkstemp
    makes 0600)."""
    write_all_atomic({path: write})


def write_all_atomic(writers: dict) -> None:
    """write_atomic for several files that belong together (a probe's rows and its summary):
    every one is staged before any is renamed into place, so a failed write replaces none."""
    staged = []
    try:
        for path, write in writers.items():
            path = pathlib.Path(path)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            os.close(fd)
            staged.append((tmp, path))
            write(tmp)
            os.chmod(tmp, 0o644)
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            pathlib.Path(tmp).unlink(missing_ok=True)


def write_parquets_atomic(frames: dict) -> None:
    """Several Parquet files at once (write_all_atomic)."""
    write_all_atomic({path: (lambda tmp, df=df: df.to_parquet(tmp, index=False)) for path, df in frames.items()})


def write_parquet_atomic(df: pd.DataFrame, path) -> None:
    write_atomic(path, lambda tmp: df.to_parquet(tmp, index=False))


def write_text_atomic(text: str, path) -> None:
    write_atomic(path, lambda tmp: pathlib.Path(tmp).write_text(text))


class ResumableSweep:
    """Collect rows keyed by a point id; skip points a previous (interrupted) run finished."""

    def __init__(self, out_path, key: str = "point"):
        self.out = pathlib.Path(out_path)
        self.partial = self.out.with_name(self.out.name + ".partial")
        self.key = key
        self.frames: list[pd.DataFrame] = []
        if self.partial.exists():
            self.frames.append(pd.read_parquet(self.partial))

    def done(self) -> set:
        return {v for f in self.frames for v in f[self.key].tolist()}

    def add(self, rows: list[dict]) -> None:
        if not rows:
            return
        self.frames.append(pd.DataFrame(rows))
        write_parquet_atomic(self.frame(), self.partial)

    def frame(self) -> pd.DataFrame:
        return pd.concat(self.frames, ignore_index=True) if self.frames else pd.DataFrame()

    def finish(self) -> pd.DataFrame:
        df = self.frame()
        write_parquet_atomic(df, self.out)
        self.partial.unlink(missing_ok=True)
        return df


VERIFY_KEYS = ["heads", "D", "prefix", "batch", "page_size"]


def peer_ratio(d: pd.DataFrame, peer: str, extra: tuple = (), suffix: str = "_peer") -> pd.DataFrame | None:
    """kdtree's verify rows joined with a peer's (`impl` == peer) on the same shapes (same run
    and inputs): ``median_us`` kdtree's, ``median_us`` + `suffix` the peer's (and so for the
    `extra` columns), ``ratio`` the peer's time over kdtree's; None without the peer's rows."""
    pr = d[d.impl == peer]
    if pr.empty:
        return None
    m = d[d.impl == "kdtree_kernel"].merge(pr[VERIFY_KEYS + ["median_us", *extra]], on=VERIFY_KEYS,
                                           suffixes=("", suffix))
    return m.assign(ratio=m["median_us" + suffix] / m.median_us)


def page_size_ratio(d: pd.DataFrame) -> pd.DataFrame:
    """kdtree's verify rows at page size 1 joined with the same shapes at page size 64:
    ``median_us`` page 1's, ``median_us_64`` page 64's, ``ratio`` page 1's time over 64's."""
    k = d[d.impl == "kdtree_kernel"]
    keys = [c for c in VERIFY_KEYS if c != "page_size"]
    m = k[k.page_size == 1].merge(k[k.page_size == 64], on=keys, suffixes=("", "_64"))
    return m.assign(ratio=m.median_us / m.median_us_64)


def flashmla_ratio(d: pd.DataFrame, extra: tuple = ()) -> pd.DataFrame | None:
    """peer_ratio against FlashMLA, its columns suffixed ``_fm``."""
    return peer_ratio(d, "flashmla", extra, suffix="_fm")


def alternated(d: pd.DataFrame) -> bool:
    """Whether these verify rows timed kdtree and FlashMLA in alternating replays (both at the
    clock the pair holds), not kdtree first (sets before a86e870)."""
    return "timing" in d and bool((d["timing"] == ALTERNATING).any())


def sustained_ratio(d: pd.DataFrame) -> pd.DataFrame | None:
    """The sustained sweep's rows as flashmla_ratio joins them: ``ratio`` over the settled
    times, ``burst_ratio`` over the bursts; None without FlashMLA rows."""
    m = flashmla_ratio(d, extra=("burst_us",))
    return None if m is None else m.assign(burst_ratio=m.burst_us_fm / m.burst_us)
