"""The sweeps, one module each; SWEEPS is their registry (the CLI's `sweep` choices, which need
a GPU, and their config section). A new sweep is a module with `run(cfg, out_path, ...)`,
an entry here and a config block (schema, config.yaml)."""
from __future__ import annotations

import importlib
from typing import NamedTuple


class Sweep(NamedTuple):
    module: str       # kdtree.harness.sweeps.<module>
    section: str      # its config block
    gpu_only: bool    # False: runs on a CPU machine too (GPU rows skipped)


SWEEPS = {
    "tree-build": Sweep("tree_build", "sweep_tree_build", False),
    "tree-accept": Sweep("tree_accept", "sweep_tree_accept", False),
    "verify-attn": Sweep("verify_attn", "sweep_verify_attn", True),
    "round": Sweep("round", "sweep_round", True),
    "worker-round": Sweep("worker_round", "sweep_worker_round", True),
    "op-latency": Sweep("op_latency", "sweep_op_latency", True),
    "verify-sustained": Sweep("verify_sustained", "sweep_verify_sustained", True),
}


def load(name: str):
    return importlib.import_module(f"{__name__}.{SWEEPS[name].module}")
