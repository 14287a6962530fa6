import os

PLOT_CODE = ["kdtree/harness/figures.py", "kdtree/harness/report.py", "kdtree/harness/breakdown.py"]


rule report:
    input:
        parquet=parquet_targets(),
        code=PLOT_CODE,
    output:
        md=f"{RD}/report.md",
        figs=[report(f"{RD}/figures/{n}.png", caption=f"../report/{n}.rst", category="figures")
              for n in figure_names()],
    log:
        f"{RD}/logs/report.log",
    params:
        rd=lambda wc, output: os.path.dirname(output.md),
        notes=skipped_notes(),
        kt=kernel_times_flag(),
    shell:
        "python3 -m kdtree report --results {params.rd} --out {output.md} --figures {params.rd}/figures "
        "{params.notes} {params.kt} > {log} 2>&1"


# `snakemake figures`: re-render from whatever Parquet the results folder holds
# (e.g. the committed reference set) with no GPU and no sweep re-run.
rule render_cached_figures:
    input:
        code=PLOT_CODE,
    output:
        touch(f"{RD}/figures/.rendered"),
    log:
        f"{RD}/logs/figures.log",
    params:
        rd=lambda wc, output: os.path.dirname(os.path.dirname(output[0])),
    shell:
        "python3 -m kdtree report --results {params.rd} --out {params.rd}/report.md "
        "--figures {params.rd}/figures > {log} 2>&1"
