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
        names=figure_flags(figure_names()),
    shell:
        "python3 -m kdtree report --results {params.rd} --out {output.md} --figures {params.rd}/figures "
        "{params.names} {params.notes} {params.kt} > {log} 2>&1"


# `snakemake figures`: re-render the figures from whatever Parquet the results folder holds
# (e.g. the committed reference set) with no GPU and no sweep re-run. The report stays the
# report rule's: it also says what its run skipped, which only that run knows.
ruleorder: report > render_cached_figures


rule render_cached_figures:
    input:
        code=PLOT_CODE,
    output:
        stamp=touch(f"{RD}/figures/.rendered"),
        figs=[f"{RD}/figures/{n}.png" for n in cached_figure_names()],
    log:
        f"{RD}/logs/figures.log",
    params:
        rd=lambda wc, output: os.path.dirname(os.path.dirname(output.stamp)),
        names=figure_flags(cached_figure_names()),
        kt=kernel_times_flag(),
    shell:
        "python3 -m kdtree figures --results {params.rd} --out {params.rd}/figures {params.names} {params.kt} "
        "> {log} 2>&1"
