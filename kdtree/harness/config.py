"""The pipeline's config schema (workflow/schemas/config.schema.yaml; an installed kdtree
carries a copy in kdtree/_schema). `kdtree sweep --cfg-json` checks its section against it,
so a bad value is refused before any work by the rules Snakemake's `validate` applies."""
from __future__ import annotations

import functools
import pathlib

from ..checks import InputError

_HERE = pathlib.Path(__file__).resolve().parent


def schema_path() -> pathlib.Path:
    for p in (_HERE.parent / "_schema" / "config.schema.yaml",                     # installed
              _HERE.parent.parent / "workflow" / "schemas" / "config.schema.yaml"):  # a checkout
        if p.exists():
            return p
    raise FileNotFoundError("config.schema.yaml: neither in the package (kdtree/_schema) nor in a checkout")


@functools.cache
def _schema() -> dict:
    import yaml
    return yaml.safe_load(schema_path().read_text())


def check_section(section: str, cfg: dict) -> None:
    """InputError naming the first bad key of config section `section` (e.g. sweep_tree_build)."""
    import jsonschema

    full = _schema()
    if section not in full["properties"]:
        raise InputError(f"{section}: not a section of the config schema")
    sub = dict(full["properties"][section], definitions=full.get("definitions", {}))
    errors = sorted(jsonschema.Draft202012Validator(sub).iter_errors(cfg), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise InputError(f"{section}{where}: {e.message}")
