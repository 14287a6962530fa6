#!/usr/bin/env bash
# The reference set's run on a GPU node that reaches no package index (docs/pipeline.md):
# the carried wheels installed into SITE, SGLang's Triton files put on the path, then
# `snakemake all` with config/reference.yaml into RESULTS. A run stopped by LIMIT keeps what
# finished; the same command on the same node resumes it (finished jobs are not rerun for
# their files' times alone, since a copied tree's times are the copy's; a lock left by a
# snakemake killed at LIMIT is removed first, where none runs in this tree).
#   scripts/reference_run.sh PEERS [RESULTS]      # PEERS: scripts/offline_peers.py's folder
# Environment: LIMIT (seconds, default none; then SIGINT, killed 20 s later if not stopped),
# SITE (/tmp/site), PYTHON (python3), CONFIG (more config as key=value words), SNAKEMAKE_ARGS
# (more flags, e.g. -n), KDTREE_GIT_COMMIT (the commit measured, where the tree has no .git).
set -uo pipefail
[ $# -ge 1 ] && [ $# -le 2 ] || { sed -n 2,11p "$0"; exit 2; }
peers=$1
rd=${2:-results/local/reference}
site=${SITE:-/tmp/site}
py=${PYTHON:-python3}
say() { echo "reference_run: $*" >&2; }
[ -d "$peers/wheels" ] || { say "PEERS: $peers has no wheels/ folder (make it with scripts/offline_peers.py)"; exit 2; }
[ -d "$peers/sglang" ] || { say "PEERS: $peers has no sglang/ folder (make it with scripts/offline_peers.py)"; exit 2; }
if ! git rev-parse HEAD > /dev/null 2>&1 && [ -z "${KDTREE_GIT_COMMIT:-}" ]; then
  say "no .git here: set KDTREE_GIT_COMMIT to the commit measured"; exit 2
fi
mkdir -p "$rd/logs" || { say "RESULTS: cannot make $rd/logs"; exit 2; }
if [ ! -d "$site/snakemake" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$peers"/wheels/*.whl \
    || { say "installing $peers/wheels into $site failed"; exit 1; }
fi
export PYTHONPATH="$site:$(realpath "$peers/sglang")${PYTHONPATH:+:$PYTHONPATH}"
log=$rd/logs/snakemake.log
# What every snakemake call here takes (the target, where one is named, goes before them).
# shellcheck disable=SC2206  # CONFIG is a list of words
common=(--profile workflow/profiles/local --configfile config/reference.yaml --config "results_dir=$rd" ${CONFIG:-})
resume=()
[ -s "$log" ] && resume=(--rerun-triggers params input software-env code)
# A run that outlived LIMIT's grace was killed and left this tree locked: unlock it, where no
# snakemake runs in this tree now, so that the same command resumes.
running_here() {
  local pid here
  here=$(pwd -P)
  for pid in $(pgrep -f -- "-m snakemake" || true); do
    [ "$(readlink "/proc/$pid/cwd" 2>/dev/null)" = "$here" ] && return 0
  done
  return 1
}
if [ -n "$(ls -A .snakemake/locks 2>/dev/null)" ]; then
  if running_here; then say "a snakemake runs in $(pwd -P): let it finish or stop it first"; exit 2; fi
  "$py" -m snakemake "${common[@]}" --unlock >> "$log" 2>&1 || { say "unlocking $(pwd -P) failed (see $log)"; exit 1; }
  say "unlocked the tree a killed run had left locked"
fi
[ ${#resume[@]} -gt 0 ] && say "resuming the run in $rd"
# LIMIT stops snakemake by SIGINT, which it handles by cancelling its jobs. A SIGTERM hung one
# run on the H100 until the kill; by snakemake 9.27's source, its TERM handler waits for the
# scheduler's lock, which the interrupted main thread may be holding.
# shellcheck disable=SC2086  # SNAKEMAKE_ARGS is a list of words
timeout -s INT -k 20 "${LIMIT:-0}" "$py" -m snakemake all "${common[@]}" "${resume[@]}" ${SNAKEMAKE_ARGS:-} \
  >> "$log" 2>&1
rc=$?
# 124: snakemake stopped at LIMIT; 137: killed 20 s later.
[ $rc -eq 124 ] || [ $rc -eq 137 ] && say "stopped at LIMIT=${LIMIT}s: run the same command again to finish"
say "snakemake exit $rc; its log: $log"
exit $rc
