rule probe_service:
    output:
        rows=f"{RD}/probe.parquet",
        summary=f"{RD}/probe_summary.parquet",
    log:
        f"{RD}/logs/probe_service.log",
    params:
        p=config["probe"],
        prompts=f"--prompts {config['probe']['prompts']}" if config["probe"]["prompts"] else "",
    shell:
        "python3 -m kdtree probe --url {params.p[url]} --out {output.rows} --requests {params.p[requests]} "
        "--concurrency {params.p[concurrency]} --max-new-tokens {params.p[max_new_tokens]} "
        "--timeout {params.p[timeout_s]} --max-wall {params.p[max_wall_s]} "
        "--max-consecutive-failures {params.p[max_consecutive_failures]} {params.prompts} "
        "--record-failure > {log} 2>&1"
