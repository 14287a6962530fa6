rule test_correctness:
    input:
        LIB,
    output:
        f"{RD}/test_correctness.parquet",
    log:
        f"{RD}/logs/test_correctness.log",
    # The tests' CPU references are most of their time: four pytest processes share the GPU.
    threads: 4
    resources:
        **job_resources(True, cpu_timed=False),
    shell:
        "python3 -m kdtree test-gpu --pin-gpu --workers {threads} --out {output} --library {input} > {log} 2>&1"
