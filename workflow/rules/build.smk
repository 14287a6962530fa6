import glob
import os
import shlex


rule build_kernels:
    input:
        sources=sorted(glob.glob("kernels/src/**/*.cu*", recursive=True)),
        header="kernels/include/kdtree.h",
        builder="kdtree/build.py",
    output:
        LIB,
    log:
        f"{RD}/logs/build_kernels.log",
    params:
        build_dir=lambda wc, output: os.path.dirname(output[0]),
        archs=" ".join(config["build"]["archs"]),
        flags=f"--extra-flags {shlex.quote(config['build']['extra_flags'])}" if config["build"].get("extra_flags") else "",
    threads: workflow.cores
    shell:
        "python3 -m kdtree build --build-dir {params.build_dir} --archs {params.archs} {params.flags} "
        "--jobs {threads} > {log} 2>&1"
