"""config/README.md, generated from workflow/schemas/config.schema.yaml and the defaults in
config/config.yaml: one table a section, every key with its default and description."""
from __future__ import annotations

import json
import pathlib

HEADER = """# Configuration

Generated from `workflow/schemas/config.schema.yaml` by `python -m kdtree config-doc`; edit
the schema, not this file. `config/config.yaml` holds the defaults (a GPU node), the presets
beside it override some keys (`smoke.yaml`: CI; `reference.yaml`: the committed reference
set; `dev.yaml`: a short GPU check). Override on the command line with
`snakemake ... --config key=value` or `--configfile FILE`. Unknown keys are refused.
"""


def _type(spec: dict, defs: dict) -> str:
    if "$ref" in spec:
        spec = dict(defs[spec["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in spec.items() if k != "$ref"})
    if "enum" in spec:
        return " \\| ".join(json.dumps(v) for v in spec["enum"])
    t = spec.get("type", "")
    if t == "array":
        return f"list of {_type(spec.get('items', {}), defs) or 'any'}"
    return t


def _fmt(v) -> str:
    return "" if v is None else f"`{json.dumps(v)}`"


def render(schema: dict, defaults: dict) -> str:
    defs = schema.get("definitions", {})
    top = [(k, s) for k, s in schema["properties"].items() if s.get("type") != "object"]
    lines = [HEADER, "## Top level", "", "| key | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {_type(s, defs)} | {_fmt(defaults.get(k))} | {s['description']} |" for k, s in top]
    for name, sec in schema["properties"].items():
        if sec.get("type") != "object":
            continue
        lines += ["", f"## `{name}`", "", sec["description"], "",
                  "| key | type | default | description |", "|---|---|---|---|"]
        d = defaults.get(name) or {}
        lines += [f"| `{k}` | {_type(s, defs)} | {_fmt(d.get(k))} | {s['description']} |"
                  for k, s in sec["properties"].items()]
    return "\n".join(lines) + "\n"


def undocumented(schema: dict, path: str = "") -> list[str]:
    """Keys without a description and objects that accept unknown keys."""
    bad = []
    for k, s in schema.get("properties", {}).items():
        if not s.get("description"):
            bad.append(f"{path}{k}: no description")
        if s.get("type") == "object":
            if s.get("additionalProperties") is not False:
                bad.append(f"{path}{k}: accepts unknown keys")
            bad += undocumented(s, f"{path}{k}.")
    return bad


def generate(root=".") -> str:
    import yaml

    root = pathlib.Path(root)
    schema = yaml.safe_load((root / "workflow/schemas/config.schema.yaml").read_text())
    defaults = yaml.safe_load((root / "config/config.yaml").read_text())
    return render(schema, defaults)
