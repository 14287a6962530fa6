#!/usr/bin/env bash
# Same-run A/B of two kdtree trees on one GPU: build both, then run the tree-build,
# tree-accept and verify-attn sweeps alternately (A B, then B A, so drift cancels).
#   git archive <old-commit> | tar -x -C ab/old      # the A side, untracked
#   scripts/ab.sh ab/old <old-commit> <new-commit> OUT_DIR
#   python3 scripts/ab_compare.py OUT_DIR            # per-point new/old ratios
# Grids are small on purpose (about 90 s on an H200 after the builds).
set -uo pipefail
old=$1 old_sha=$2 new_sha=$3 out=$4
mkdir -p "$out"
export KDTREE_GIT_DIRTY=0 PYTHONUNBUFFERED=1
TB='{"batches":[1,16,64],"budgets":[16,64,256,1024],"L":15,"vocab":8192,"seed":0,"cpu_reps":1,"cpu_max_seconds":0.2,"gpu_replays":20,"gpu_mem_cap_gb":40}'
TA='{"batches":[1,16,64],"slots":[17,65,257],"L":15,"seed":0,"follow_rates":[0.85],"cpu_reps":1,"cpu_max_seconds":0.2,"gpu_replays":20,"gpu_mem_cap_gb":40}'
VA='{"heads":[8,64],"slots":[16,64],"prefixes":[8192,32768],"batches":[1,16],"page_sizes":[1,64],"scale":0.130861,"seed":0,"gpu_replays":10,"graph_inner":3,"sdpa_max_elems":1,"gpu_mem_cap_gb":40}'
(cd "$old" && python3 -m kdtree build --archs sm_90a --jobs 16) > "$out/build_old.log" 2>&1 || echo "old build failed"
python3 -m kdtree build --archs sm_90a --jobs 16 > "$out/build_new.log" 2>&1 || echo "new build failed"
for order in "old new" "new old"; do
  rep=$([ "$order" = "old new" ] && echo 1 || echo 2)
  for v in $order; do
    dir=$([ $v = old ] && echo "$old" || echo .)
    export KDTREE_GIT_COMMIT=$([ $v = old ] && echo "$old_sha" || echo "$new_sha")
    for s in tree-build:$TB tree-accept:$TA verify-attn:$VA; do
      name=${s%%:*} cfg=${s#*:}
      (cd "$dir" && timeout 300 python3 -m kdtree sweep "$name" --out "$(realpath "$out")/${v}_${name}_$rep.parquet" \
        --cfg-json "$cfg") > "$out/${v}_${name}_$rep.log" 2>&1 || echo "$v $name $rep failed"
    done
  done
done
