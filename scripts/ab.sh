#!/usr/bin/env bash
# Same-run A/B of kdtree builds on one GPU. Each SIDE is NAME=DIR[@COMMIT][:FLAGS]: a tree
# (a `git archive` of another commit, or . for the working tree), the commit its rows record
# (default: what git says in DIR, else unknown) and extra nvcc flags for a variant of it.
# Every side is built into its own folder and GPU-tested (TESTS, a pytest -k expression;
# empty: no tests), then the sweeps run ROUNDS times, the sides' order reversed every other
# round so that drift cancels; each side's sweeps run from its own tree, so its Python and
# its library agree.
#   mkdir -p ab/main && git archive <commit> | tar -x -C ab/main
#   scripts/ab.sh OUT main=ab/main@<commit> new=. gated=.:-DKD_SOME_FLAG=1
#   python3 scripts/ab_compare.py OUT main        # per-point ratios of every side to main
# Environment: SWEEPS (default: tree-build tree-accept verify-attn), CFG_<SWEEP> (a sweep's
# --cfg-json, e.g. CFG_VERIFY_ATTN), ROUNDS (2), TESTS (default: the GPU tests of the swept
# kernels), ARCHS (sm_90a), JOBS (build jobs a side). Default grids take about 90 s a side
# and round on an H200. Where the tree is a copy whose .git may lag its files (the device
# tool's), name the commit the rows should record: new=.@<commit>.
set -uo pipefail
[ $# -ge 3 ] || { sed -n 2,16p "$0"; exit 2; }
out=$(mkdir -p "$1" && realpath "$1"); shift
sweeps=${SWEEPS:-tree-build tree-accept verify-attn}
rounds=${ROUNDS:-2}
tests=${TESTS-tree_build or tree_accept or verify}
archs=${ARCHS:-sm_90a}
jobs=${JOBS:-$(( $(nproc) / $# > 1 ? $(nproc) / $# : 1 ))}
CFG_TREE_BUILD=${CFG_TREE_BUILD:-'{"batches":[1,16,64],"budgets":[16,64,256,1024],"drafts":["mixed","confident"],"max_topk":256,"L":15,"vocab":8192,"seed":0,"cpu_reps":1,"cpu_max_seconds":0.02,"gpu_replays":20,"gpu_mem_cap_gb":40}'}
CFG_TREE_ACCEPT=${CFG_TREE_ACCEPT:-'{"batches":[1,16,64],"slots":[17,65,257],"L":15,"seed":0,"follow_rates":[0.85],"cpu_reps":1,"cpu_max_seconds":0.2,"gpu_replays":20,"gpu_mem_cap_gb":40}'}
CFG_VERIFY_ATTN=${CFG_VERIFY_ATTN:-'{"heads":[8,64],"slots":[16,64],"prefixes":[8192,32768],"batches":[1,16],"page_sizes":[1,64],"scale":0.130861,"seed":0,"gpu_replays":10,"graph_inner":3,"sdpa_max_elems":1,"gpu_mem_cap_gb":40}'}
export PYTHONUNBUFFERED=1

names=() dirs=() flags=() commits=()
for side in "$@"; do
  name=${side%%=*} rest=${side#*=}
  [[ $side == *=* && $name =~ ^[A-Za-z0-9.-]+$ ]] || { echo "ab.sh: SIDE must be NAME=DIR[@COMMIT][:FLAGS], got '$side'" >&2; exit 2; }
  dir=${rest%%:*} flag="" commit="" dirty=0
  [[ $rest == *:* ]] && flag=${rest#*:}
  if [[ $dir == *@* ]]; then commit=${dir#*@} dir=${dir%%@*}
  elif commit=$(git -C "$dir" rev-parse HEAD 2>/dev/null); then
    [ -n "$(git -C "$dir" status --porcelain 2>/dev/null)" ] && dirty=1
  else commit=unknown; fi
  [ -d "$dir/kdtree" ] || { echo "ab.sh: $dir has no kdtree package (side $name)" >&2; exit 2; }
  # The sweeps check their config against the schema a checkout keeps here (kdtree/harness/config.py).
  [ -f "$dir/workflow/schemas/config.schema.yaml" ] || [ -f "$dir/kdtree/_schema/config.schema.yaml" ] \
    || { echo "ab.sh: $dir has no workflow/schemas/config.schema.yaml (side $name; archive the whole commit)" >&2; exit 2; }
  names+=("$name") dirs+=("$(realpath "$dir")") flags+=("$flag") commits+=("$commit $dirty")
done
printf '%s\n' "${names[@]}" > "$out/sides.txt"

for i in "${!names[@]}"; do  # builds side by side
  (cd "${dirs[$i]}" && python3 -m kdtree build --archs $archs --jobs "$jobs" --build-dir "$out/build/${names[$i]}" \
     "--extra-flags=${flags[$i]}") > "$out/build_${names[$i]}.log" 2>&1 &
done
wait
for i in "${!names[@]}"; do
  lib=$out/build/${names[$i]}/libkdtree.so
  [ -s "$lib" ] || { echo "ab.sh: side ${names[$i]} did not build (see $out/build_${names[$i]}.log)" >&2; exit 1; }
  if [ -n "$tests" ] && [ ! -d "${dirs[$i]}/tests" ]; then
    echo "${names[$i]}: no tests/ in ${dirs[$i]}, not tested"
  elif [ -n "$tests" ]; then
    (cd "${dirs[$i]}" && KDTREE_LIB=$lib python3 -m pytest -q -m gpu tests -k "$tests") > "$out/tests_${names[$i]}.log" 2>&1
    echo "${names[$i]}: $(tail -1 "$out/tests_${names[$i]}.log")"
  fi
done

for rep in $(seq 1 "$rounds"); do
  order=("${!names[@]}")
  if (( rep % 2 == 0 )); then order=($(printf '%s\n' "${order[@]}" | tac)); fi
  for i in "${order[@]}"; do
    for sweep in $sweeps; do
      var=CFG_$(echo "$sweep" | tr a-z- A-Z_)
      read -r commit dirty <<< "${commits[$i]}"
      (cd "${dirs[$i]}" && KDTREE_GIT_COMMIT=$commit KDTREE_GIT_DIRTY=$dirty timeout 600 python3 -m kdtree sweep "$sweep" --library "$out/build/${names[$i]}/libkdtree.so" \
         --out "$out/${names[$i]}_${sweep}_$rep.parquet" --cfg-json "${!var}") > "$out/${names[$i]}_${sweep}_$rep.log" 2>&1 \
        || echo "${names[$i]} $sweep round $rep failed (see its log)"
    done
  done
done
echo "ab.sh: done; python3 scripts/ab_compare.py $out ${names[0]}"
