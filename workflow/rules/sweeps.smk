rule sweep_tree_build:
    input:
        unpack(lambda wc: gpu_inputs()),
    output:
        report(f"{RD}/tree_build.parquet", caption="../report/tree_build.rst", category="data"),
    log:
        f"{RD}/logs/sweep_tree_build.log",
    params:
        cfg=sweep_json("sweep_tree_build"),
        flags=gpu_flags,
    resources:
        gpu=1 if GPU else 0,
    shell:
        "python3 -m kdtree sweep tree-build --pin-gpu --out {output} --cfg-json {params.cfg} {params.flags} > {log} 2>&1"


rule sweep_tree_accept:
    input:
        unpack(lambda wc: gpu_inputs()),
    output:
        f"{RD}/tree_accept.parquet",
    log:
        f"{RD}/logs/sweep_tree_accept.log",
    params:
        cfg=sweep_json("sweep_tree_accept"),
        flags=gpu_flags,
    resources:
        gpu=1 if GPU else 0,
    shell:
        "python3 -m kdtree sweep tree-accept --pin-gpu --out {output} --cfg-json {params.cfg} {params.flags} > {log} 2>&1"


rule sweep_verify_attn:
    input:
        lib=LIB,
        tests=f"{RD}/test_correctness.parquet",
    output:
        f"{RD}/verify_attn.parquet",
    log:
        f"{RD}/logs/sweep_verify_attn.log",
    params:
        cfg=sweep_json("sweep_verify_attn"),
    resources:
        gpu=1,
    shell:
        "python3 -m kdtree sweep verify-attn --pin-gpu --out {output} --cfg-json {params.cfg} "
        "--library {input.lib} --require-tests {input.tests} > {log} 2>&1"
