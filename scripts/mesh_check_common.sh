# Shared by scripts/gpu_mesh_check.sh and scripts/cpu_mesh_check.sh (sourced, not
# run): their arguments (SHAPE WORKLOADS [OUT]), folders and log, `step` (a command
# with a time limit, logged, its failure remembered in $status) and `finish` (the
# mesh logs archived, the exit status). The sourcing script sets `name` first: the
# default OUT is bench-results/$name, the default WORK /tmp/$name.
set -u
shape=$1
workloads=$2
out=${3:-bench-results/$name}
python=${PYTHON:-python3}
work=${WORK:-/tmp/$name}
mkdir -p "$out" "$work"
log="$out/run.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0

step() {  # step SECONDS NAME COMMAND...: run with a time limit, log, remember failure
    local limit=$1 name=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S))" | tee -a "$log"
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 0 ] || { echo "== $name failed: $rc" | tee -a "$log"; status=1; }
}

finish() {  # the stage and coordinator logs, for a failed step; exit with the status
    (cd "$work" && find . -type d -name logs -print0 | tar -czf - --null -T -) \
        >"$out/mesh-logs.tar.gz" 2>/dev/null || true
    exit $status
}
