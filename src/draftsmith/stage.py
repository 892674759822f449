"""Glue for the thin scripts in stages/: paths from the command line, the config from
params.yaml, timing, metrics JSON, and clean errors (no traceback for a user's mistake)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from draftsmith.atomic import write_json
from draftsmith.config import Config, load_config
from draftsmith.errors import DraftsmithError


def stage_main(name: str, run: Callable[[Config, argparse.Namespace], dict],
               paths: list[str], dist: ModuleType | None = None,
               one_process: Callable[[Config], bool] = lambda cfg: False) -> None:
    """dist: `draftsmith.dist`, for a stage that can run data parallel: with `distributed`
    params asking for more than one process it relaunches itself under torchrun, and only rank
    0 writes metrics. The stage imports it and passes it here, so only those stages have
    dist.py in their code deps. one_process(cfg): the stage runs as one process whatever
    `distributed` says (hidden with a serving engine, which spreads the target itself)."""
    parser = argparse.ArgumentParser(prog=f"stages.{name}", description=f"Draftsmith stage '{name}'")
    parser.add_argument("--params", default="params.yaml", help="parameters file")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a parameter (repeatable), e.g. --set generate.seed=1")
    for p in paths:
        parser.add_argument(f"--{p}", required=True, type=Path)
    parser.add_argument("--metrics", type=Path, help="write the stage's metrics JSON here")
    args = parser.parse_args()
    # `kill` (and schedulers' preemption) sends SIGTERM: unwind like Ctrl-C so a launched
    # server is stopped and no half-written artifact is left.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    main = True
    try:
        cfg = load_config(args.params, args.set)
        if dist is not None and one_process(cfg):
            dist = None
        if dist is not None:
            argv = dist.torchrun_argv(cfg.distributed, f"stages.{name}", sys.argv[1:])
            if argv:
                os.execv(argv[0], argv)  # torchrun takes this process's place (and its pid)
            main = dist.init(cfg.distributed).main
        t0 = time.time()
        metrics = run(cfg, args)
        metrics["wall_s"] = round(time.time() - t0, 1)
    except DraftsmithError as exc:
        print(f"error in stage '{name}': {exc}", file=sys.stderr)
        sys.exit(2)
    finally:
        if dist is not None:
            dist.finish()
    if not main:
        return
    if args.metrics:
        write_json(args.metrics, metrics)
    print(f"{name}: " + json.dumps(metrics))
