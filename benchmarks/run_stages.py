"""Run dvc.yaml's stage commands in order and time each: the pipeline where DVC is not installed
(the H200 image has none, and DVC cannot be carried there as wheels: one of its dependencies
ships only as source). `dvc repro` is the normal way; this runs the same commands, with no
cache and no skipping. Writes the wall time and exit status of each stage as it goes, and
stops at the first failure.

    python benchmarks/run_stages.py --json stage_times.json [--logs DIR] [STAGE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stages", nargs="*", help="default: every stage of dvc.yaml, in its order")
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--logs", type=Path, help="one log per stage (default: the terminal)")
    a = p.parse_args(argv)
    stages = yaml.safe_load((a.repo / "dvc.yaml").read_text())["stages"]
    unknown = [s for s in a.stages if s not in stages]
    if unknown:
        p.error(f"no stage {unknown} in dvc.yaml (stages: {', '.join(stages)})")
    times = json.loads(a.json.read_text()) if a.json.exists() else {}  # resumed runs add to it
    for name in a.stages or list(stages):
        cmd = " ".join(stages[name]["cmd"].split())
        print(f"stage {name}: {cmd}", flush=True)
        log = open(a.logs / f"{name}.log", "w") if a.logs else None
        t0 = time.time()
        rc = subprocess.run(cmd, shell=True, cwd=a.repo, stdout=log, stderr=subprocess.STDOUT
                            if log else None).returncode
        times[name] = {"wall_s": round(time.time() - t0, 1), "rc": rc}
        a.json.write_text(json.dumps(times, indent=2) + "\n")
        print(f"stage {name}: rc {rc} in {times[name]['wall_s']} s", flush=True)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
