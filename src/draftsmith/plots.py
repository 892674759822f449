"""PNG plots (matplotlib, no network): DVC shows image plots offline, unlike its vega ones."""

from __future__ import annotations

from pathlib import Path

from draftsmith.atomic import atomic_path


def _figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)


def plot_training(curve: list[dict], path: Path) -> None:
    """Loss and per-step top-1 accuracy against the target over training."""
    plt = _figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    steps = [r["step"] for r in curve]
    a.plot(steps, [r["loss"] for r in curve])
    a.set_xlabel("step")
    a.set_ylabel("weighted TTT loss")
    for key in [k for k in curve[0] if k.startswith("acc_")]:
        b.plot(steps, [r[key] for r in curve], label=f"step {key[4:]}")
    b.set_xlabel("step")
    b.set_ylabel("top-1 agreement with target")
    b.set_ylim(0, 1)
    b.legend(fontsize=7, ncol=2)
    fig.suptitle("Drafter training")
    _save(plt, fig, path)


def plot_acceptance(by_engine: dict[str, list[dict]], baseline: dict | None, path: Path) -> None:
    """Acceptance rate per draft position: each engine at each temperature, and the random
    drafter (what acceptance looks like when the drafter knows nothing)."""
    plt = _figure()
    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    rows = [(f"{e} T={r['temperature']} (AL {r['acceptance_length']:.2f})", r)
            for e, results in by_engine.items() for r in results]
    if baseline:
        rows.append((f"random drafter (AL {baseline['acceptance_length']:.2f})", baseline))
    k = rows[0][1]["k"]
    width = 0.8 / len(rows)
    for i, (label, r) in enumerate(rows):
        xs = [p + 1 + (i - len(rows) / 2 + 0.5) * width for p in range(k)]
        ax.bar(xs, r["acceptance_rate_per_position"], width, label=label)
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1)
    ax.set_title("Drafter acceptance per position (held-out prompts)")
    ax.legend(fontsize=7)
    _save(plt, fig, path)


def plot_methods(rows: list[dict], path: Path) -> None:
    """The drafter methods side by side (benchmarks/methods.py): acceptance rate per draft
    position (reference engine bars, vLLM dots), and the speedup each implies as the target's
    forward grows against the drafter's (tau / (1 + cost / X))."""
    plt = _figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    k = rows[0]["k"]
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [p + 1 + (i - len(rows) / 2 + 0.5) * width for p in range(k)]
        al = r["acceptance_length_reference"]["T0.0"]
        bars = a.bar(xs, r["acceptance_per_position_reference_T0"], width,
                     label=f"{r['run']} (AL {al:.2f})")
        if r["acceptance_per_position_vllm_T0"]:
            a.plot(xs, r["acceptance_per_position_vllm_T0"], "o", color="black", ms=3,
                   label="vLLM" if i == 0 else None)
        xs_ = [2 ** (e / 4) for e in range(4, 33)]
        b.plot(xs_, [al / (1 + r["draft_cost_in_eagle3_forwards"] / x) for x in xs_],
               color=bars.patches[0].get_facecolor(), label=r["run"])
    a.set_xticks(range(1, k + 1))
    a.set_xlabel("draft position")
    a.set_ylabel("acceptance rate (T=0)")
    a.set_ylim(0, 1)
    a.legend(fontsize=7)
    b.set_xscale("log")
    b.set_xlabel("target forward / one EAGLE-3 drafter forward (weight bytes)")
    b.set_ylabel("implied speedup")
    b.legend(fontsize=7)
    fig.suptitle("Drafter methods on the same target and data")
    _save(plt, fig, path)
