# kdtree: build the kernels, test them, sweep them against CPU and library baselines,
# probe a live service, render figures. Logic lives in `python -m kdtree ...`.
from snakemake.utils import min_version, validate

min_version("9.0")

configfile: "config/config.yaml"


# `--config gpu=false` arrives as a string: normalise before validation.
config["gpu"] = {"true": True, "false": False}.get(str(config.get("gpu")).lower(), config.get("gpu"))
validate(config, "workflow/schemas/config.schema.yaml")


container: config["container"]


include: "workflow/rules/common.smk"
include: "workflow/rules/build.smk"
include: "workflow/rules/tests.smk"
include: "workflow/rules/sweeps.smk"
include: "workflow/rules/probe.smk"
include: "workflow/rules/figures.smk"


# Cheap joins and renders stay on the submitting host under a cluster executor.
localrules:
    all,
    figures,
    gather_tree_build,
    gather_verify_attn,
    report,
    render_cached_figures,


rule all:
    input:
        all_targets(),


rule figures:
    input:
        f"{RD}/figures/.rendered",
