"""benchmarks/mla_capture_gap.py keeps working between runs, and its causal test bites: on the
random MLA + MoE toy (deepseek_dir: its router scores near-tied everywhere, so bf16 flips some
choices) the tokens over 1/16 all sit behind a routing flip, and pinning the routing to the
reference's choice leaves none."""

import json
import subprocess
import sys
from pathlib import Path

from draftsmith.config import TargetConfig
from draftsmith.target import resolve

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "mla_capture_gap.py"


def test_pinned_routing_leaves_no_token_over_tol(deepseek_dir, tmp_path):
    resolve(TargetConfig(model=str(deepseek_dir)), tmp_path / "target")
    # One thread: a toy this small gains nothing from two, and OpenMP threads waiting for a
    # core that other processes hold made a pass take seconds instead of a fraction of one.
    subprocess.run([sys.executable, str(SCRIPT), "--target", str(tmp_path / "target"),
                    "--samples", "16", "--threads", "1", "--pairs", "bf16_vs_fp32",
                    "eager_vs_sdpa", "--json", str(tmp_path / "r.json")],
                   check=True, capture_output=True, timeout=300)
    res = json.loads((tmp_path / "r.json").read_text())["results"]["mla"]
    assert res["architecture"] == "DeepseekV3ForCausalLM" and res["tokens"] > 500
    for pair in ("bf16_vs_fp32", "eager_vs_sdpa"):
        unpinned, pinned = res[pair]["unpinned"], res[pair]["pinned"]
        assert list(unpinned["per_layer"]) == ["layer 1", "layer 2", "layer 3", "layer 4",
                                               "last"]
        assert list(unpinned["flips_per_moe_layer"]) == ["1", "2", "3", "4", "5", "6"]
        assert unpinned["tokens_with_a_flip"] > 0 and pinned["tokens_with_a_flip"] == 0
        for name, u in unpinned["per_layer"].items():
            p = pinned["per_layer"][name]
            assert u["tokens"] == p["tokens"] == res["tokens"]
            assert u["over_tol_with_flip_in_context"] == u["tokens_over_tol"], (pair, name)
            assert p["tokens_over_tol"] == 0 and p["p99_diff_of_scale"] <= 1 / 32, (pair, name)
        ties = res[pair]["near_ties"]
        assert ties["at_first_flips"]["median"] < ties["all"]["median"] / 10
    assert sum(u["tokens_over_tol"]
               for u in res["bf16_vs_fp32"]["unpinned"]["per_layer"].values()) > 0
