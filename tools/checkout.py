"""A fresh git checkout of a working tree (tracked and untracked files, not ignored ones), for
the tests and the benchmark scripts that run `dvc repro` apart from the working tree:

    from checkout import copy_checkout   # with tools/ on sys.path
    copy_checkout(repo, dest)
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def copy_checkout(src: Path, dest: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=src,
                           capture_output=True, text=True, check=True).stdout.split()
    for f in files:
        if (src / f).is_file():
            (dest / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / f, dest / f)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run([*git, "add", "-A"], cwd=dest, check=True)
    subprocess.run([*git, "commit", "-qm", "init"], cwd=dest, check=True)
    return dest
