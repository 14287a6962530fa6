"""kdtree: CUDA kernels for DDTree tree speculative decoding on MLA models.

Three ops, one naming scheme, each with a named result type that ``out=`` also takes:
``tree_build`` -> TreeBuildResult, ``tree_verify`` (or a TreeVerifyPlan's ``run``) ->
TreeVerifyResult, ``tree_accept`` -> TreeAcceptResult. Their CPU references are
``tree_build_ref``, ``tree_verify_ref`` and ``tree_accept_ref`` (module ``kdtree.reference``).
The ops are also registered as torch ops (``torch.ops.kdtree.*``, see kdtree.torch_ops) for
torch.compile, and ``kdtree.sglang`` speaks SGLang's DDTree worker formats.
"""
from __future__ import annotations

from importlib import metadata as _metadata

from .checks import InputError
from .ops import (STATUS_BUDGET_CLAMPED, STATUS_NAN_INPUT, STATUS_WARP_LOOP, VERIFY_KERNELS,
                  TreeAcceptResult, TreeBuildResult, TreeVerifyPlan, TreeVerifyResult, tree_accept,
                  tree_build, tree_verify)
from .reference import softmax_scale, stage_a
from .reference import tree_accept as tree_accept_ref
from .reference import tree_build as tree_build_ref
from .reference import tree_verify as tree_verify_ref
from . import torch_ops  # noqa: E402,F401  (registers torch.ops.kdtree.*)

try:
    __version__ = _metadata.version("kdtree")
except _metadata.PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0.2.0+checkout"


def __getattr__(name: str):
    """``kdtree.sglang`` on first use, as the README writes it (``import kdtree`` alone does
    not load the drop-in: importing it with ``KDTREE_SGLANG=1`` patches a worker, with
    ``KDTREE_SGLANG_ATTENTION=1`` SGLang's Triton backend)."""
    if name == "sglang":
        import importlib
        return importlib.import_module(".sglang", __name__)
    raise AttributeError(f"module 'kdtree' has no attribute {name!r}")


__all__ = [
    "__version__", "InputError", "STATUS_BUDGET_CLAMPED", "STATUS_NAN_INPUT", "STATUS_WARP_LOOP",
    "VERIFY_KERNELS", "TreeAcceptResult", "TreeBuildResult", "TreeVerifyPlan", "TreeVerifyResult",
    "softmax_scale", "stage_a", "tree_accept", "tree_accept_ref", "tree_build", "tree_build_ref",
    "tree_verify", "tree_verify_ref",
]
