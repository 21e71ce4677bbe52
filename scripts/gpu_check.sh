#!/usr/bin/env bash
# The CUDA path on a host with an NVIDIA GPU and a CUDA build of torch: the GPU tests
# (every supported family split on the GPU, eager and replayed as CUDA graphs per
# session and per batch bucket, batched frames, bfloat16 replays against eager
# frames, the int4/int8 linears; the CUDA int4 layout) and benchmarks/graph_bench.py
# for two model shapes (decode tokens, and verify windows of 4 rows on the smaller).
# Run from the repository root; results go to OUT (default bench-results/gpu).
#
#     scripts/gpu_check.sh [OUT]        (PYTHON=... picks the interpreter)
set -u
out=${1:-bench-results/gpu}
python=${PYTHON:-python3}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
"$python" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$out/gpu.txt"
status=0
"$python" -m pytest -q -p no:cacheprovider -rs tests/unit/test_runtime_cuda.py \
    tests/unit/test_runtime_graphs.py \
    "tests/unit/test_quant.py::test_cuda_int4_layout_takes_whole_tiles_only" 2>&1 | tee "$out/tests.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# SmolLM2-135M's shape (30 small layers: launches weigh most), then TinyLlama-1.1B's.
"$python" benchmarks/graph_bench.py --json "$out/graph-small.json" --layers 30 --hidden 576 \
    --intermediate 1536 --heads 9 --kv-heads 3 --vocab 49152 2>&1 | tee "$out/graph-small.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
# Verify windows of 4 rows per session, the same small shape.
"$python" benchmarks/graph_bench.py --json "$out/graph-small-w4.json" --layers 30 --hidden 576 \
    --intermediate 1536 --heads 9 --kv-heads 3 --vocab 49152 --window 4 --batches 1 2 4 8 \
    2>&1 | tee "$out/graph-small-w4.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
"$python" benchmarks/graph_bench.py --json "$out/graph-1b.json" 2>&1 | tee "$out/graph-1b.log"
[ "${PIPESTATUS[0]}" = 0 ] || status=1
exit $status
