#!/usr/bin/env bash
# The GPU run behind benchmarks/results/gpu_check_*: each drafter the pipeline made served by GPU
# vLLM and by SGLang beside the reference engine (benchmarks/gpu_serve.py), and vLLM's
# hidden-state capture beside transformers' per layer (benchmarks/hidden_engines.py), on two
# toys that benchmarks/gpu/make_runs.py builds on the CPU:
#   RUN/llama  the embedded Qwen3 toy (params.yaml, models/target, data/raw) with one drafter
#              per method in drafters/<method>/{drafter,export};
#   RUN/mla    an MLA + MoE toy with DeepSeek's head dims (qk_nope 128, rope 64, v 128: the
#              only kind GPU vLLM's MLA prefill takes), its MLA EAGLE-3 drafter in models/.
# The parts run at once (the toys need a sliver of the GPU; each vLLM server a fixed one): each
# drafter's serving, the capture of both toys, the GPU tests. Each writes its JSON as it goes,
# so a run cut short keeps what finished. Usage, with vLLM importable (PYTHONPATH), results
# to $OUT, PARTS any of "serve capture tests sampling alone sglang" (default the first three):
#   bash benchmarks/gpu/check.sh RUN [PARTS]
# DRAFTERS: the Llama toy's drafters to serve (default every folder in RUN/llama/drafters; an
# engine without an export for one, SGLang for P-EAGLE, skips it; " " none). Without RUN/mla
# the MLA toy's parts are left out; without RUN/llama, SGLang's generate.
# sglang: the drafters served by SGLang (unpacked by tools/gpu_wheelhouse.py into
# $SGLANG_SITE, default /tmp/sglang-site; it runs from there alone, its transformers pin apart
# from the pipeline's), the targets alone in it, and the generate stage through it; in lanes
# at once, after the vLLM parts (SGLang sizes its pool from the memory free at its start).
set -uo pipefail
RUN=${1:?the folder holding llama/ and mla/}
OUT=${OUT:-results}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: some parts work in other folders
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/src" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
       VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
SERVE="python3 -m vllm.entrypoints.cli.main serve {model}"
# A fixed KV cache: vLLM then skips the free-memory profiling that fails when another process
# on the GPU frees memory meanwhile (it did, the first time: "Error in memory profiling")
# 1 GiB of KV is 130k tokens of the fp32 Llama toy, twice the benchmark's 60 prompts at once;
# at 0.07 of an 80 GB GPU ten servers start side by side
MEM=${MEM:-"--gpu-memory-utilization 0.07 --kv-cache-memory-bytes 1073741824"}
python3 -c "import vllm, torch, transformers; print('vllm', vllm.__version__, 'torch', \
torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/versions.txt"

PARTS=${2:-"serve capture tests"}
d=drafters
DRAFTERS=${DRAFTERS:-$(ls "$RUN/llama/$d")}
serve() {  # serve NAME REPO DRAFTER EXPORT [FLAGS...]: one drafter through gpu_serve.py
    local name=$1 repo=$2 drafter=$3 export=$4; shift 4
    python3 benchmarks/gpu_serve.py --repo "$repo" --server-command "$SERVE" \
        --extra-args="$MEM" --drafter "${name%%+*}=$drafter:$export" "$@" \
        --out "$OUT/gpu_serve_$name.json" > "$OUT/gpu_serve_$name.log" 2>&1
    echo "gpu_serve $name rc=$?" >> "$OUT/rc.txt"
}
PROB='{"draft_sample_method": "probabilistic"}'
if [[ $PARTS == *sampling* ]]; then  # T>0 with vLLM drafting from the drafter's distribution
    for m in $DRAFTERS; do
        serve "$m+probabilistic" "$RUN/llama" "$d/$m/drafter" "$d/$m/export" \
            --temperatures 0.6 --speculative-config "$PROB" &
        sleep 10
    done
fi
if [[ $PARTS == *alone* ]]; then  # the bf16 MLA target alone in vLLM, greedy, against HF's
    serve mla-eagle3+alone "$RUN/mla" models/drafter models/export --temperatures 0 --alone &
fi
if [[ $PARTS == *serve* ]]; then  # every drafter at once, each with its own server
    for m in $DRAFTERS; do
        serve "$m" "$RUN/llama" "$d/$m/drafter" "$d/$m/export" &
        sleep 10
    done
    [[ -d $RUN/mla ]] && serve mla-eagle3 "$RUN/mla" models/drafter models/export &
fi
if [[ $PARTS == *capture* ]]; then
    (for toy in llama $([[ -d $RUN/mla ]] && echo mla); do
         python3 benchmarks/hidden_engines.py --repo "$RUN/$toy" --device cuda \
             --server-command "$SERVE" --extra-args="$MEM" --tol 0.0625 \
             --json "$OUT/hidden_engines_$toy.json" > "$OUT/hidden_engines_$toy.log" 2>&1
         echo "hidden_engines $toy rc=$?" >> "$OUT/rc.txt"
     done) &
fi
if [[ $PARTS == *tests* ]]; then
    (# the CUDA kernels from their new home (src/draftsmith_kernels), on the GPU
     python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_fused_forward.py \
         > "$OUT/gpu_tests.log" 2>&1
     echo "gpu tests rc=$?" >> "$OUT/rc.txt"
     # No GPU MLA backend takes float32 (each one's supported_dtypes): the MLA toy in float32
     # should be refused at start, naming the dtype
     timeout 240 python3 -m vllm.entrypoints.cli.main serve "$RUN/mla/models/target/model" \
         --dtype float32 $MEM --port 18123 > "$OUT/mla_float32_serve.log" 2>&1
     echo "mla float32 serve rc=$?" >> "$OUT/rc.txt") &
fi
if [[ $PARTS == *sglang* ]]; then
    wait  # the vLLM parts first: SGLang sizes its pool from the memory free at its start
    source benchmarks/gpu/sglang_env.sh
    # --max-total-tokens caps each pool (130k tokens, as vLLM's 1 GiB above), so a high static
    # share (what SGLang may take, less what is in use at its start) leaves room for the lanes
    SGLMEM=${SGLMEM:-"--mem-fraction-static 0.8 --max-total-tokens 131072 $SGL_SAMPLER"}
    sgl() {  # sgl NAME REPO DRAFTER EXPORT EXTRA [FLAGS...]; once more without CUDA graphs
        local name=$1 repo=$2 drafter=$3 export=$4 extra=$5 rc; shift 5
        python3 benchmarks/gpu_serve.py --engine sglang --repo "$repo" --server-command "$SGL" \
            --extra-args="$SGLMEM $extra" --drafter "$name=$drafter:$export" "$@" \
            --out "$OUT/gpu_serve_sglang_$name.json" > "$OUT/gpu_serve_sglang_$name.log" 2>&1
        rc=$?; echo "gpu_serve sglang $name rc=$rc" >> "$OUT/rc.txt"
        [[ $rc == 0 || $extra == *--disable-cuda-graph* ]] && return
        sgl "$name+nograph" "$repo" "$drafter" "$export" "$extra --disable-cuda-graph" "$@"
    }
    # the Llama toy is float32: FlashAttention 3 (SGLang's Hopper default) takes 16-bit only
    TRITON="--attention-backend triton"
    lane=0
    for m in $DRAFTERS; do
        [[ -d $RUN/llama/$d/$m/export/sglang ]] || continue
        alone=""; (( lane == 0 )) && alone=--alone  # the target alone, once
        sgl "$m" "$RUN/llama" "$d/$m/drafter" "$d/$m/export" "$TRITON" $alone &
        lane=$((lane + 1)); sleep 20
    done
    [[ -d $RUN/mla ]] && { sgl mla-eagle3 "$RUN/mla" models/drafter models/export "" --alone &
                           sleep 20; }
    # generate and tokenize (which checks the chat format) through SGLang, on the Llama toy
    [[ -d $RUN/llama ]] && (sglang_generate "$RUN/llama" "$OUT" "$SGLMEM $TRITON"
                            echo "sglang generate rc=$?" >> "$OUT/rc.txt") &
fi
wait
cat "$OUT/rc.txt"
