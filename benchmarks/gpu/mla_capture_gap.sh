#!/usr/bin/env bash
# The MLA capture gap's routing-flip test (benchmarks/mla_capture_gap.py) on a GPU: the tests'
# MLA toy and the H200 toy's shape (hidden 128, head_dim 128, 1,200 steps: the MLA toy of the
# H200 capture comparison, benchmarks/results/README.md), each built by the target stage on the
# host's CPU (target.embedded.device: cpu, its default; fp32), then transformers' bf16 against
# fp32 and eager against SDPA on the GPU, routing recorded and pinned. Needs no vLLM; WHEELS:
# pydantic's wheels. Results in benchmarks/results/mla_capture_gap_h100*.json.
#   bash benchmarks/gpu/mla_capture_gap.sh RESULTS [WHEELS]
set -uo pipefail
R=${1:?results folder} WHEELS=${2:-}
mkdir -p "$R"
[[ -n $WHEELS ]] && python3 -m pip install -q --no-index --no-deps --target /tmp/pyd "$WHEELS"/*.whl
export PYTHONPATH="/tmp/pyd:$PWD/src:$PWD/benchmarks" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv > "$R/gpu.txt" 2>&1
python3 benchmarks/mla_capture_gap.py --target tiny-mla --dense-target tiny --samples 400 \
    --device cuda --json "$R/mla_capture_gap_cuda.json" > "$R/tiny.log" 2>&1
echo "tiny-mla rc=$?" >> "$R/rc.txt"
python3 -c "from pathlib import Path; from draftsmith import target; from draftsmith.config import \
EmbeddedTargetConfig as E, TargetConfig as T; print(target.resolve(T(model='embedded-mla', \
embedded=E(hidden_size=128, num_layers=7, num_heads=4, head_dim=128, train_steps=1200)), \
Path('/tmp/gpu-shape-target')))" > "$R/h128_target.log" 2>&1
python3 benchmarks/mla_capture_gap.py --target /tmp/gpu-shape-target --samples 400 \
    --device cuda --json "$R/mla_capture_gap_cuda_h128.json" > "$R/h128.log" 2>&1
echo "h128 rc=$?" >> "$R/rc.txt"
cp "$R/rc.txt" "$R/DONE"
