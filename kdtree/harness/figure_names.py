"""The figures the harness draws, by name: one from each sweep's Parquet file, and the
whole-step breakdown from the probe's with them. Each is `figures.<name>` and `<name>.png`.
A module of its own so that the CLI and the workflow can name them without importing the
plotting stack."""
import pathlib

PER_PARQUET = ("tree_build", "verify_attn", "tree_accept", "worker_round", "verify_sustained")
BREAKDOWN = "step_breakdown"  # needs probe.parquet (and the sweeps' rows)
ALL = PER_PARQUET + (BREAKDOWN,)


def default_folder(results_dir) -> pathlib.Path:
    """Where a run's figures go unless told otherwise: beside its Parquet."""
    return pathlib.Path(results_dir) / "figures"
