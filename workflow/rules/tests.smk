rule test_correctness:
    input:
        LIB,
    output:
        f"{RD}/test_correctness.parquet",
    log:
        f"{RD}/logs/test_correctness.log",
    resources:
        **job_resources(True, cpu_timed=False),
    shell:
        "python3 -m kdtree test-gpu --pin-gpu --out {output} --library {input} > {log} 2>&1"
