"""One line a stage from metrics/*.json: the figures a person looks at after `dvc repro`
(`dvc metrics show` prints every key of every stage, about 100 columns; `dvc metrics diff`
stays the way to compare commits)."""

from __future__ import annotations

import json
from pathlib import Path

from draftsmith.errors import DraftsmithError


def _n(x) -> str:
    return f"{x:,}" if isinstance(x, int) else str(x)


def _size(n_bytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} B"


def _per_position(xs: list) -> str:
    return " / ".join(f"{x:.3f}" for x in xs)


def target(m: dict) -> str:
    params = m.get("parameters")
    size = f"{params / 1e9:.2f} B" if params and params >= 1e9 else \
        f"{params / 1e6:.2f} M" if params else "?"
    line = f"{m.get('kind', 'target')}, {size} parameters"
    if "heldout_loss" in m:
        line += f"; held-out loss {m['heldout_loss']}, answer accuracy {m.get('answer_accuracy')}"
    return line


def generate(m: dict) -> str:
    return (f"{_n(m.get('samples'))} samples, {_n(m.get('errors', 0))} errors; reasoning captured "
            f"{m.get('reasoning_capture_rate', 0):.0%}; {m.get('mean_response_tokens')} tokens a "
            f"response ({m.get('backend')})")


def tokenize(m: dict) -> str:
    return (f"{_n(m.get('samples_kept'))} of {_n(m.get('samples_in'))} kept; format check "
            f"{m.get('format_check_pass_rate', 0):.0%}; {_n(m.get('tokens'))} tokens, "
            f"{_n(m.get('loss_tokens'))} trained on")


def vocab(m: dict) -> str:
    return (f"{_n(m.get('draft_vocab_size'))} of {_n(m.get('target_vocab_size'))} tokens cover "
            f"{m.get('coverage', 0):.2%} of the trained tokens")


def hidden(m: dict) -> str:
    line = f"{m.get('mode')} through {m.get('engine')}"
    if m.get("tokens"):
        line = (f"{_n(m['tokens'])} tokens of layers {m.get('aux_layers')}, {m.get('dtype')}, "
                f"{_size(m.get('bytes', 0))} ({line})")
    return line


def train(m: dict) -> str:
    acc = m.get("eval_accuracy") or []
    return (f"{m.get('method')} ({m.get('drafter_arch')}), {_n(m.get('steps'))} steps on "
            f"{m.get('device')}; held-out accuracy {_per_position(acc)} at positions 1-{len(acc)}")


def export(m: dict) -> str:
    return f"vLLM and SGLang layouts, {m.get('dtype')}, {_size(m.get('bytes', 0))}"


def benchmark(m: dict) -> str:
    by = "; ".join(f"{engine} " + ", ".join(f"T={t[1:]} {al}" for t, al in temps.items())
                   for engine, temps in (m.get("by_engine") or {}).items())
    lossless = "lossless" if not m.get("not_lossless") else \
        f"NOT lossless: {m['not_lossless']}"
    se = f" +- {m['acceptance_length_se']}" if m.get("acceptance_length_se") else ""
    line = (f"acceptance length {m.get('acceptance_length')}{se} at k={m.get('k')} ({by}); "
            f"{lossless}")
    if "random_drafter_acceptance_length" in m:
        line += f"; a random drafter {m['random_drafter_acceptance_length']}"
    return line


# each stage's line, in the pipeline's order
STAGES = {"target": target, "generate": generate, "tokenize": tokenize, "vocab": vocab,
          "hidden": hidden, "train": train, "export": export, "benchmark": benchmark}


def lines(metrics_dir: Path) -> list[str]:
    """The summary, a header and one line a stage (those not run yet say so)."""
    metrics_dir = Path(metrics_dir)
    if not metrics_dir.is_dir():
        raise DraftsmithError(f"{metrics_dir}: no metrics folder; run the pipeline first "
                              f"(`make repro` or `dvc repro`), or pass the folder it wrote")
    out = [f"{'stage':<10} {'wall s':>7}  what it made"]
    for stage, line in STAGES.items():
        f = metrics_dir / f"{stage}.json"
        if not f.exists():
            out.append(f"{stage:<10} {'':>7}  not run yet")
            continue
        try:
            m = json.loads(f.read_text())
            text = line(m)
        except (ValueError, TypeError, AttributeError, KeyError) as exc:
            text = f"unreadable ({type(exc).__name__}: {exc}); `dvc metrics show {f}` shows it"
            m = {}
        wall = m.get("wall_s")
        out.append(f"{stage:<10} {'' if wall is None else wall:>7}  {text}")
    return out
