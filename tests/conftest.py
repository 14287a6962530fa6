"""Shared fixtures. GPU tests carry the `gpu` marker and skip cleanly without a CUDA device."""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

DATA = pathlib.Path(__file__).parent / "data"


def pytest_collection_modifyitems(config, items):
    try:
        import torch
        has_gpu = torch.cuda.is_available()
    except Exception:  # pragma: no cover - torch missing is an install error elsewhere
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="no CUDA device on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def golden():
    """The DDTree authors' reference outputs (copied from shared/golden)."""
    d = np.load(DATA / "ddtree_reference_cases.npz")
    return [{k.split("/", 1)[1]: d[k] for k in d.files if k.startswith(f"{i}/")}
            for i in range(int(d["count"]))]
