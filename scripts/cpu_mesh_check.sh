#!/usr/bin/env bash
# A CPU mesh on a machine with cores to spare: the serving and pipeline benchmarks of
# a 2-stage mesh, 1 torch thread per stage, where every process (coordinator, each
# stage, the client's streams) can have a core of its own. On a 2-core machine the
# stages, the coordinator and the client share two cores, so these ratios say as much
# about the machine as about the mesh; this check takes them where cores are not the
# limit.
#
# The model has the shape of SHAPE (a model directory's config.json and tokenizer
# files; weights are not needed) with random weights (scripts/random_model.py),
# packaged here as int4 (group 32, int8 head) and float32, so the check needs no
# download. Random weights make the text meaningless but the work per token that of
# the real model.
#
#     scripts/cpu_mesh_check.sh SHAPE WORKLOADS [OUT]
#
# Runs, each with a time limit: serving_bench (int4: 1/2/4/8/16 streams, 2 repeats),
# pipeline_bench (int4: 1 and 2 stages), serving_bench (float32: 1/4/8 streams, 1),
# serving_bench on int4 with the served default speculation against none (1 and 8
# streams), pipeline_bench (float32). JSON and
# one log go to OUT (default bench-results/cpu-mesh); PYTHON picks the interpreter,
# WORK the scratch folder. MESH_KERNEL_CACHE may name a folder of prebuilt stage
# kernels (mesh/runtime/native.py) for a machine without a C compiler.
name=cpu-mesh
. "$(dirname "$0")/mesh_check_common.sh"
{
    echo "cores: $(nproc)"
    grep -m1 "model name" /proc/cpuinfo
    grep -m1 -o -w -E "avx512_vnni|amx_int8" /proc/cpuinfo | sort -u | tr '\n' ' '
    echo
    "$python" -c "import torch; print('torch', torch.__version__)"
    "$python" -c "from mesh.runtime import native; print('kernels', native.library())"
} 2>&1 | tee -a "$log"

step 180 "random model" "$python" scripts/random_model.py "$shape" "$work/model"
step 180 "package int4" "$python" -m mesh.package.cli build "$work/model" \
    --out "$work/pkg-int4" --quant int4 --model-id random-int4
step 180 "package float32" "$python" -m mesh.package.cli build "$work/model" \
    --out "$work/pkg-float32" --dtype float32 --model-id random-float32

common=(--workloads "$workloads" --max-tokens 64 --threads 1 --heartbeat-timeout 60)
serving() {  # serving QUANT STREAMS REPEATS SECONDS
    step "$4" "serving $1" "$python" benchmarks/serving_bench.py "${common[@]}" \
        --package "$work/pkg-$1" --concurrency "$2" --repeats "$3" --speculation none \
        --workdir "$work/serving-$1" --out "$out/serving-$1.json"
}
pipeline() {  # pipeline QUANT REPEATS SECONDS
    step "$3" "pipeline $1" "$python" benchmarks/pipeline_bench.py \
        --package "$work/pkg-$1" --stages 1,2 --threads 1 --max-tokens 64 \
        --workloads "$workloads" --repeats "$2" --workdir "$work/pipeline-$1" \
        --out "$out/pipeline-$1.json"
}
# Most wanted first: a run cut short by its time limit keeps what it finished.
serving int4 1,2,4,8,16 2 150
pipeline int4 5 90
# float32 decodes at about 15 tokens/s a stream on one thread: one repeat of 1/4/8
# streams took 120 s on a 16-core Xeon, two ran past 180 s.
serving float32 1,4,8 1 200
step 120 "serving int4, speculation" "$python" benchmarks/serving_bench.py "${common[@]}" \
    --package "$work/pkg-int4" --concurrency 1,8 --repeats 2 --speculation none,package \
    --workdir "$work/serving-spec" --out "$out/serving-int4-spec.json"
pipeline float32 3 100
finish
