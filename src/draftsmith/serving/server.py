"""A server the pipeline starts itself: launched on the target, bound to 127.0.0.1 unless
configured, healthy within a bound, and always stopped when the stage ends (so the accelerator
is free for the next stage, which the seed story had to do by hand).

`server_argv` turns `server:` in params.yaml into an engine's command line: the configured
launcher (the engine's own by default, engines.py) followed by the arguments every run needs.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from draftsmith.chat_format import ChatFormat
from draftsmith.config import ServerConfig
from draftsmith.errors import DraftsmithError
from draftsmith.serving.engines import DEFAULT, ENGINES
from draftsmith.serving.memory import EngineNeed, engine_memory


def reasoning_parser(fmt: ChatFormat, engine: str = DEFAULT) -> str | None:
    """The engine's reasoning parser for a format: the <think>...</think> families, where the
    engine has parsers for them. Others get none, so their reasoning stays inline in
    `content`, verbatim, and is parsed here."""
    parsers = ENGINES[engine].think_parsers
    if parsers and fmt.supports_reasoning and \
            (fmt.open_tag.strip(), fmt.close_tag) == ("<think>", "</think>"):
        return parsers[1] if fmt.prompt_opens_reasoning else parsers[0]
    return None


def server_argv(cfg: ServerConfig, *, model_dir: Path, served_name: str, port: int, dtype: str,
                seed: int, chat_format: ChatFormat, extra: list[str] = ()) -> list[str]:
    engine = ENGINES[cfg.engine]
    command = cfg.command or engine.launch
    argv = shlex.split(command.format(model=shlex.quote(str(model_dir))))
    argv += ["--host", cfg.host, "--port", str(port), "--served-model-name", served_name,
             "--dtype", dtype, engine.seed_flag, str(seed)]
    parser = reasoning_parser(chat_format, cfg.engine)
    if parser:
        argv += ["--reasoning-parser", parser]
    return argv + list(extra) + shlex.split(cfg.extra_args)


@contextmanager
def serve_target(cfg: ServerConfig, target_dir: Path, log_dir: Path, *, seed: int,
                 extra: list[str] = (), launch: bool | None = None,
                 need: EngineNeed | None = None) -> Iterator[list[str]]:
    """Base URLs serving the target: `server.urls` as given, or (with `server.launch`, or
    `launch=True`) one server started on the target here and stopped on exit. need: what the
    stage asks of it and keeps for itself; the engine's memory is then sized for both
    (serving/memory.py), unless the user's own flags size it."""
    if not (cfg.launch if launch is None else launch):
        yield list(cfg.urls)
        return
    from draftsmith.target_info import read_info

    info = read_info(target_dir)
    port = cfg.port or free_port(cfg.host)
    argv = server_argv(cfg, model_dir=info.model_dir(target_dir), served_name=info.model,
                       port=port, dtype=info.dtype, seed=seed, chat_format=info.format,
                       extra=[*(["--trust-remote-code"] if info.trust_remote_code else []), *extra])
    if need is not None:
        memory = engine_memory(cfg, info.model_dir(target_dir), info.dtype, need, argv)
        argv += memory.args
        print(memory.note)
        for warning in memory.warnings:
            print(warning, file=sys.stderr)
    server = ManagedServer(argv, host=cfg.host, port=port, log_file=Path(log_dir) / "server.log",
                           startup_timeout_s=cfg.startup_timeout_s)
    print(f"starting {cfg.engine} on {server.url} (log: {server.log_file})")
    with server:
        print(f"{cfg.engine} healthy after {server.startup_s} s")
        yield [server.url]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# Runs beside a launched server, in a session of its own: when the process that launched the
# server dies, even by SIGKILL (no `finally` runs then), it stops the server's whole session.
_WATCHDOG = """
import os, signal, sys, time
parent, group = int(sys.argv[1]), int(sys.argv[2])
while os.getppid() == parent:
    time.sleep(0.5)
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit()  # the server is gone: nothing left to guard
for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 0)):
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        sys.exit()
    for _ in range(int(wait * 2)):
        time.sleep(0.5)
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            sys.exit()
"""


# A line that states an exception ("ValueError: ..."), at its start or after the "(Worker
# pid=..) ERROR .. [file.py:9] " prefix the engine puts before it; never one a warning quotes.
_EXCEPTION = re.compile(r"(?:^|\] )([A-Z][\w.]*(?:Error|Exception): .+)")
_WRAPPERS = ("See root cause above", "Engine core initialization failed")


class ManagedServer:
    """`with ManagedServer(argv, ...) as url:` starts the server, waits for `/health` and stops
    it (the whole process group) on exit, even when the body raises or is interrupted; a
    watchdog process stops it if the launching process is killed outright."""

    startups: list[float] = []  # seconds to healthy of every start in this process (reports)

    def __init__(self, argv: list[str], *, host: str, port: int, log_file: Path,
                 startup_timeout_s: float, env: dict | None = None):
        self.argv, self.host, self.port = argv, host, port
        self.log_file, self.timeout, self.env = Path(log_file), startup_timeout_s, env
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> str:
        self.start()
        return self.url

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self._leftovers = set(glob.glob("/tmp/vllm_dist_*"))
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", **(self.env or {})}
        t0 = time.time()
        with open(self.log_file, "w") as log:
            # A session of its own: stopping it reaches the engine's worker processes too.
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT,
                                         env=env, start_new_session=True)
        self.watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(os.getpid()), str(self.proc.pid)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.time() - t0, 1)
        ManagedServer.startups.append(self.startup_s)

    def _wait_healthy(self) -> None:
        deadline = time.time() + self.timeout
        health = self.url.removesuffix("/v1") + "/health"
        while time.time() < deadline:
            if self.proc.poll() is not None:
                cause = self.root_cause()
                raise DraftsmithError(
                    f"the server exited (code {self.proc.returncode}) before it became healthy"
                    + (f": {cause}" if cause else "")
                    + f"; last lines of {self.log_file}:\n{self.log_tail()}",
                    f"fix the error above; the command was: {shlex.join(self.argv)}")
            try:
                if httpx.get(health, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise DraftsmithError(
            f"the server did not become healthy within {self.timeout:.0f} s; last lines of "
            f"{self.log_file}:\n{self.log_tail()}",
            "raise server.startup_timeout_s if it is still loading, or fix the error above")

    def kill(self) -> None:
        """Kill the server abruptly (SIGKILL), as a crash or a lost node would."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace_s: float = 30) -> None:
        if self.proc and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        if getattr(self, "watchdog", None) and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        # vLLM leaves a /tmp/vllm_dist_<hex> rendezvous file behind on every start.
        for path in set(glob.glob("/tmp/vllm_dist_*")) - getattr(self, "_leftovers", set()):
            Path(path).unlink(missing_ok=True)

    def root_cause(self) -> str | None:
        """The first exception the server's log names, less the wrappers that only say a
        worker failed (vLLM's engine core raises `Engine core initialization failed. See root
        cause above`, which is all the log's last lines show)."""
        try:
            text = self.log_file.read_text(errors="replace")
        except OSError:
            return None
        for line in text.splitlines():
            m = _EXCEPTION.search(line)
            if m and not any(w in m.group(1) for w in _WRAPPERS):
                cause = m.group(1).strip()
                return cause if len(cause) <= 400 else cause[:400] + " ..."
        return None

    def log_tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
