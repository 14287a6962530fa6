"""scripts/tail_schedule_sim.py, the host model behind verify_plan.cu's `tail` row
(docs/kernels/verify_attention.md, v25): its scheduler and its verdict on the rule's gates."""
import importlib.util
import pathlib
import subprocess
import sys

import pandas as pd

SCRIPT = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "tail_schedule_sim.py"


def load():
    spec = importlib.util.spec_from_file_location("tail_schedule_sim", SCRIPT)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def test_scheduler_takes_the_first_free_sm_in_grid_order():
    sim = load()
    assert sim.schedule([5, 3, 2, 2], sms=2) == 7   # 5 | 3 then 2 (ends 5); the last 2 starts at 5
    assert sim.schedule([5, 3, 2, 4], sms=2) == 9   # the 4 waits for an SM until 5
    assert sim.schedule([1] * 10, sms=4) == 3
    assert sim.piece(10, 3, 0) == 4 + sim.TURNAROUND_TILES and sim.piece(10, 3, 2) == 2 + sim.TURNAROUND_TILES
    assert sim.piece(10, 3, 3) == sim.EMPTY_TILES and sim.piece(2, 3, 2) == sim.EMPTY_TILES


def test_the_gated_rule_is_never_slower_in_the_model(tmp_path):
    out = tmp_path / "sim.parquet"
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    df = pd.read_parquet(out)
    assert len(df) > 100 and (df.ratio <= 1.0).all() and df.ratio.median() < 0.95
    # Every shape the rule takes has 8 or more whole row tiles a request and a part-full last one.
    rows = (df.budget + 1) * df.H
    assert ((rows // 64) >= 8).all() and ((rows % 64) != 0).all()
    # B 16, H 8, budget 64 (144 row tiles on 132 SMs): the case the rule was made for.
    pick = df[(df.B == 16) & (df.H == 8) & (df.budget == 64) & (df.P == 8192) & (df.table == 131072)]
    assert len(pick) == 1 and float(pick.ratio.iloc[0]) < 0.9
