#!/usr/bin/env bash
# Drafter training speed on one H200 (issue "drafter training at the limit"): each part a
# process of its own, results to RESULTS as they come, RESULTS/DONE when all have finished
# (each part's exit status in RESULTS/rc.txt). Run detached and poll (device calls end at
# 600 s):
#   setsid nohup bash benchmarks/gpu/train.sh RESULTS [WHEELS] > /tmp/train.log 2>&1 &
# WHEELS: a folder of wheels the image lacks (pydantic ...), installed to /tmp/pyd.
# PARTS (default all, in this order):
#   cold     the first step of each drafter layer at the Kimi shape, T = 8,192, with empty
#            inductor and kernel caches, the soft-CE build in it as the train stage has it
#            (what a user's first run on a machine pays), on each of COLD_ATTENTIONS
#   mla      the MLA layer at the Kimi shape, T = 8,192 and 16,384, flex / flash / cuDNN
#   llama8b  the Llama layer at the 8B shape, T = 16,384, flex / flash / cuDNN
#   numerics the GPU tests: the kernels (built with nvcc, against their references), packed
#            attention, the fused forward, bf16 fast path vs the fp64 reference, every
#            attention and layer (NUMERICS: the pytest arguments, to run fewer)
#   specforge SpecForge's EAGLE-3 step beside ours, 8B shape, T = 2,048 and LONG (its wheel in
#            WHEELS: pip download --no-deps specforge==0.2.0 -d .whl), each of SPECFORGE_IMPLS
#   llama    the Llama layer at the Kimi shape, T = 8,192 and 16,384, flex / flash / cuDNN
#   docs     packed rows (DOCS documents of LONG / DOCS tokens each, as the train stage packs
#            them), MLA at the Kimi shape and Llama at the 8B shape, on each of DOCS_ATTENTIONS
# PROFILE=1: also each case's operator profile (RESULTS/profile_*.txt).
# BASELINE=DIR: the parts mla, llama8b and llama also run DIR's code, a tree with the same
#   layout (git archive <commit> src benchmarks/train_ttt.py benchmarks/_common | tar x -C DIR),
#   each case right after this tree's, into RESULTS/train_ttt_<part>_baseline.json: a change
#   measured against its parent on the same machine in the same run. DIR is an ignored path:
#   carry it on every device call of the run (a call without it removes it from the machine's
#   copy while the run goes on).
# A dry run on a CPU (what it runs, at toy size; the GPU tests skip):
#   KIMI=toy B8=toy SHORT=64 LONG=128 ATTENTIONS=auto bash benchmarks/gpu/train.sh /tmp/r
set -uo pipefail
KIMI=${KIMI:-kimi-k2} B8=${B8:-8b} SHORT=${SHORT:-8192} LONG=${LONG:-16384}
ATTENTIONS=${ATTENTIONS:-flex flash cudnn} COLD_ATTENTIONS=${COLD_ATTENTIONS:-auto}
DOCS=${DOCS:-4 16} DOCS_ATTENTIONS=${DOCS_ATTENTIONS:-cudnn flex}
SPECFORGE_IMPLS=${SPECFORGE_IMPLS:-ours specforge specforge-compact}
NUMERICS=${NUMERICS:-tests/test_kernels.py tests/test_packed_attention.py tests/test_fused_forward.py \
tests/test_train_fast.py::test_gpu_fast_path_matches_reference_in_bf16 \
tests/test_train_fast.py::test_gpu_bf16_layer_matches_the_fp64_reference \
tests/test_methods.py::test_gpu_dflash_objective_matches_the_fp64_reference \
tests/test_speculative.py::test_generate_on_cuda_matches_the_cpu}
R=${1:?results folder} WHEELS=${2:-}
mkdir -p "$R"
R=$(cd "$R" && pwd)
[[ -n $WHEELS ]] && python3 -m pip install -q --no-index --no-deps --target /tmp/pyd "$WHEELS"/*.whl
export PYTHONPATH="/tmp/pyd:$PWD/src" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$R/gpu.txt" 2>&1
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())" \
    > "$R/versions.txt" 2>&1
export DRAFTSMITH_KERNEL_CACHE=$R/kernels  # built once for the parts that time it apart
ttt() {  # ttt NAME ARGS...: one train_ttt.py process, its own empty inductor cache
    local cache; cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$cache python3 benchmarks/train_ttt.py --kinds fast \
        --json "$R/train_ttt_$1.json" ${PROFILE:+--profile "$R"} "${@:2}" \
        > "$R/train_ttt_$1.log" 2>&1
    echo "$1 rc=$?" >> "$R/rc.txt"
}
compare() {  # compare NAME ARGS...: ttt, then the same case on BASELINE's code if set
    ttt "$@"
    [[ -z ${BASELINE:-} ]] && return
    local cache; cache=$(mktemp -d)
    TORCHINDUCTOR_CACHE_DIR=$cache PYTHONPATH="/tmp/pyd:$BASELINE/src" \
        python3 "$BASELINE/benchmarks/train_ttt.py" --kinds fast \
        --json "$R/train_ttt_$1_baseline.json" "${@:2}" > "$R/train_ttt_$1_baseline.log" 2>&1
    echo "$1_baseline rc=$?" >> "$R/rc.txt"
}
for part in ${PARTS:-cold mla llama8b numerics specforge docs llama}; do
    case $part in
        cold) for arch in llama mla; do
                  for attention in $COLD_ATTENTIONS; do
                      DRAFTSMITH_KERNEL_CACHE=$(mktemp -d) ttt "cold_${arch}_$attention" \
                          --preset "$KIMI" --archs "$arch" --lengths "$SHORT" --iters 2 \
                          --attentions "$attention" --first-step-builds
                  done
              done ;;
        mla) compare mla --preset "$KIMI" --archs mla --lengths "$SHORT" "$LONG" \
                 --attentions $ATTENTIONS ;;
        llama8b) compare llama8b --preset "$B8" --lengths "$LONG" --attentions $ATTENTIONS ;;
        llama) compare llama --preset "$KIMI" --archs llama --lengths "$SHORT" "$LONG" \
                   --attentions $ATTENTIONS ;;
        specforge) python3 benchmarks/specforge_step.py --preset "$B8" --lengths 2048 "$LONG" \
                       --impls $SPECFORGE_IMPLS --json "$R/specforge_step.json" \
                       > "$R/specforge_step.log" 2>&1
                   echo "specforge rc=$?" >> "$R/rc.txt" ;;
        docs) for n in $DOCS; do
                  ttt "docs${n}_mla" --preset "$KIMI" --archs mla --lengths "$LONG" \
                      --docs "$n" --attentions $DOCS_ATTENTIONS
                  ttt "docs${n}_llama8b" --preset "$B8" --lengths "$LONG" --docs "$n" \
                      --attentions $DOCS_ATTENTIONS
              done ;;
        numerics) python3 -m pytest -q -rs --durations=15 -p no:cacheprovider $NUMERICS \
                      > "$R/numerics.log" 2>&1
                  echo "numerics rc=$?" >> "$R/rc.txt" ;;
        *) echo "unknown part $part" >> "$R/rc.txt" ;;
    esac
done
touch "$R/DONE"
