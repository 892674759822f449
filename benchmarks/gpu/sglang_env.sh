# Sourced by the H200 scripts (check.sh, pipeline.sh): SGLang as they run it, in one
# place. SGLang runs from its own folder, SGLANG_SITE (tools/gpu_wheelhouse.py's install.sh
# unpacks it there): it pins transformers 5.12.1, the pipeline runs on the image's.
SGL="env PYTHONPATH=${SGLANG_SITE:-/tmp/sglang-site} PYTHONUNBUFFERED=1 python3 -m \
sglang.launch_server --model-path {model}"
# The sampler in PyTorch: FlashInfer's would JIT-compile at every start.
SGL_SAMPLER="--sampling-backend pytorch"

# sglang_generate SRC OUT EXTRA_ARGS: the generate and tokenize stages through SGLang (the
# seed's pivot), reasoning kept, 200 prompts, on a copy: this checkout's code with SRC's
# params.yaml and target. Metrics and logs into OUT (absolute); exit status as the stages'.
sglang_generate() {
    local src=$1 out=$2 extra=$3 g=$1-sglang-generate
    rm -rf "$g" && mkdir -p "$g/models" "$out/sglang_generate_logs" /tmp/bin
    # the stages' commands run `python`; the image has python3 only (a wrapper, not a link:
    # its python3 is a virtual environment's)
    printf '#!/bin/sh\nexec python3 "$@"\n' > /tmp/bin/python && chmod +x /tmp/bin/python
    tar --exclude=./.git --exclude='./.gpu-*' --exclude=./.whl --exclude=./.venv \
        --exclude=./data --exclude=./models -cf - . | tar -xf - -C "$g"
    cp -r "$src/models/target" "$g/models/" && cp "$src/params.yaml" "$g/" || return 1
    printf 'server:\n  command: "%s"\n  extra_args: "%s"\nhidden:\n  engine: hf\ngenerate:\n  num_samples: 200\n' \
        "$SGL" "$extra" > "$out/sglang_generate.yaml"
    (cd "$g" && export PATH="/tmp/bin:$PATH" \
     && python3 -m draftsmith.cli config preset presets/sglang.yaml "$out/sglang_generate.yaml" \
     && python3 benchmarks/run_stages.py --json "$out/sglang_generate_stages.json" \
            --logs "$out/sglang_generate_logs" generate tokenize \
     && cp metrics/generate.json "$out/sglang_generate.json" \
     && cp metrics/tokenize.json "$out/sglang_tokenize.json") > "$out/sglang_generate.log" 2>&1
}
