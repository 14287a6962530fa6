# The tree-build and verify sweeps run as shards (one per batch size / head count) so a
# cluster can spread them over many GPUs; gather rules join the shards.


rule sweep_tree_build_shard:
    input:
        unpack(lambda wc: gpu_inputs()),
        code=sweep_code("tree_build"),
    output:
        f"{RD}/shards/tree_build/batch{{batch}}.parquet",
    log:
        f"{RD}/logs/sweep_tree_build/batch{{batch}}.log",
    params:
        cfg=lambda wc: sweep_json("sweep_tree_build", batches=[int(wc.batch)]),
        flags=gpu_flags,
    resources:
        **job_resources(GPU, cpu_timed=True),
    shell:
        "python3 -m kdtree sweep tree-build --pin-gpu --out {output} --cfg-json {params.cfg} {params.flags} > {log} 2>&1"


rule gather_tree_build:
    input:
        expand(f"{RD}/shards/tree_build/batch{{batch}}.parquet", batch=config["sweep_tree_build"]["batches"]),
    output:
        report(f"{RD}/tree_build.parquet", caption="../report/tree_build.rst", category="data"),
    log:
        f"{RD}/logs/gather_tree_build.log",
    shell:
        "python3 -m kdtree gather --out {output} {input} > {log} 2>&1"


rule sweep_tree_accept:
    input:
        unpack(lambda wc: gpu_inputs()),
        code=sweep_code("tree_accept"),
    output:
        f"{RD}/tree_accept.parquet",
    log:
        f"{RD}/logs/sweep_tree_accept.log",
    params:
        cfg=sweep_json("sweep_tree_accept"),
        flags=gpu_flags,
    resources:
        **job_resources(GPU, cpu_timed=True),
    shell:
        "python3 -m kdtree sweep tree-accept --pin-gpu --out {output} --cfg-json {params.cfg} {params.flags} > {log} 2>&1"


rule sweep_verify_attn_shard:
    input:
        lib=LIB,
        tests=f"{RD}/test_correctness.parquet",
        code=sweep_code("verify_attn"),
    output:
        f"{RD}/shards/verify_attn/heads{{heads}}.parquet",
    log:
        f"{RD}/logs/sweep_verify_attn/heads{{heads}}.log",
    params:
        cfg=lambda wc: sweep_json("sweep_verify_attn", heads=[int(wc.heads)]),
    resources:
        **job_resources(True, cpu_timed=False),
    shell:
        "python3 -m kdtree sweep verify-attn --pin-gpu --out {output} --cfg-json {params.cfg} "
        "--library {input.lib} --require-tests {input.tests} > {log} 2>&1"


rule gather_verify_attn:
    input:
        expand(f"{RD}/shards/verify_attn/heads{{heads}}.parquet", heads=config["sweep_verify_attn"]["heads"]),
    output:
        f"{RD}/verify_attn.parquet",
    log:
        f"{RD}/logs/gather_verify_attn.log",
    shell:
        "python3 -m kdtree gather --out {output} {input} > {log} 2>&1"


# The unsharded GPU sweeps (kdtree.harness.sweeps.SWEEPS): one rule for all of them.
rule sweep_gpu:
    input:
        lib=LIB,
        tests=f"{RD}/test_correctness.parquet",
        code=lambda wc: sweep_code(wc.name),
    output:
        f"{RD}/{{name}}.parquet",
    log:
        f"{RD}/logs/sweep_{{name}}.log",
    wildcard_constraints:
        name="|".join(GPU_SWEEPS),
    params:
        cfg=lambda wc: sweep_json(f"sweep_{wc.name}"),
        which=lambda wc: wc.name.replace("_", "-"),
    resources:
        **job_resources(True, cpu_timed=False),
        bench=lambda wc: int(wc.name == "worker_round"),  # it times the worker's CPU path
    shell:
        "python3 -m kdtree sweep {params.which} --pin-gpu --out {output} --cfg-json {params.cfg} "
        "--library {input.lib} --require-tests {input.tests} > {log} 2>&1"
