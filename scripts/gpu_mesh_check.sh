#!/usr/bin/env bash
# A mesh of stage processes on a GPU, served and measured end to end: the coordinator,
# 2 stage processes on the same CUDA device (--device cuda:0, --cuda-graphs) joined by
# their TCP data links, stage 0's OpenAI endpoint driven by the openai client.
#
# The model has the shape of SHAPE (a model directory's config.json and tokenizer
# files; weights are not needed) with random weights (scripts/random_model.py),
# packaged as bfloat16 and float32 here, so the check needs no download. Random
# weights make the text meaningless but the work per token that of the real model;
# each request's greedy text under several streams is compared with its text alone
# (serving_bench's "same text as 1 stream").
#
#     scripts/gpu_mesh_check.sh SHAPE WORKLOADS [OUT]
#
# Runs the GPU tests and benchmarks/graph_invariance.py (bfloat16, float32), then
# serving_bench (bfloat16: 1/4/8/16 streams), pipeline_bench (1 and 2 stages),
# serving_bench again (float32: 1/8 streams; bfloat16 without CUDA graphs: 1/8).
# JSON and one log go to OUT (default bench-results/gpu-mesh); PYTHON picks the
# interpreter, WORK the scratch folder, DEVICE the stages' device (cuda:0).
name=gpu-mesh
. "$(dirname "$0")/mesh_check_common.sh"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'cuda', torch.cuda.is_available())" 2>&1 | tee -a "$log"

# The GPU tests, and whether a session's logits depend on the frame it runs in.
step 180 "GPU tests" "$python" -m pytest -q -p no:cacheprovider -rs \
    tests/unit/test_runtime_cuda.py tests/unit/test_runtime_graphs.py
for dtype in bfloat16 float32; do
    step 90 "graph invariance $dtype" "$python" benchmarks/graph_invariance.py \
        --dtype "$dtype" --json "$out/graph-invariance-$dtype.json"
done

step 120 "random model" "$python" scripts/random_model.py "$shape" "$work/model"
for dtype in bfloat16 float32; do
    step 120 "package $dtype" "$python" -m mesh.package.cli build "$work/model" \
        --out "$work/pkg-$dtype" --dtype "$dtype" --model-id "random-$dtype"
done

bench=(--device "${DEVICE:-cuda:0}" --workloads "$workloads" --max-tokens 64 --heartbeat-timeout 60)
step 240 "serving bfloat16, graphs" "$python" benchmarks/serving_bench.py "${bench[@]}" \
    --cuda-graphs --package "$work/pkg-bfloat16" --concurrency 1,4,8,16 --repeats 2 \
    --workdir "$work/serving-bf16" --out "$out/serving-bf16.json"
step 150 "pipeline bfloat16, graphs" "$python" benchmarks/pipeline_bench.py \
    --device "${DEVICE:-cuda:0}" --cuda-graphs --package "$work/pkg-bfloat16" --stages 1,2 \
    --workloads "$workloads" --repeats 3 --workdir "$work/pipeline" \
    --out "$out/pipeline-bf16.json"
step 150 "serving float32, graphs" "$python" benchmarks/serving_bench.py "${bench[@]}" \
    --cuda-graphs --package "$work/pkg-float32" --concurrency 1,8 --repeats 2 \
    --workdir "$work/serving-f32" --out "$out/serving-f32.json"
step 150 "serving bfloat16, eager" "$python" benchmarks/serving_bench.py "${bench[@]}" \
    --package "$work/pkg-bfloat16" --concurrency 1,8 --repeats 2 \
    --workdir "$work/serving-bf16-eager" --out "$out/serving-bf16-eager.json"
finish
