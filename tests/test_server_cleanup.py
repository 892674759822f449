"""A server launched by a stage dies with the stage, even when the stage is SIGKILLed (no
`finally` runs then): the launcher's watchdog stops the server's whole session."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# A stand-in server (any command can be launched: server.command): answers /health and starts
# a worker of its own, as vLLM starts its engine core.
FAKE_SERVER = textwrap.dedent("""
    import http.server, subprocess, sys
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[1], "w").write(f"{worker.pid}\\n")
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), H).serve_forever()
""")

LAUNCHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from draftsmith.serving.server import ManagedServer, free_port
    fake, pids, log = sys.argv[1:4]
    port = free_port("127.0.0.1")
    s = ManagedServer([sys.executable, fake, pids, str(port)], host="127.0.0.1", port=port,
                      log_file=Path(log), startup_timeout_s=60)
    with s:
        print(s.proc.pid, flush=True)
        time.sleep(600)
""")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")  # a zombie has exited; only its entry waits to be reaped


def test_sigkilled_launcher_leaves_no_server_behind(tmp_path):
    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(fake), str(tmp_path / "pids"), str(tmp_path / "log")],
        stdout=subprocess.PIPE, text=True)
    server_pid = int(launcher.stdout.readline())
    worker_pid = int((tmp_path / "pids").read_text())
    assert alive(server_pid) and alive(worker_pid)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 30
    while time.time() < deadline and (alive(server_pid) or alive(worker_pid)):
        time.sleep(0.5)
    assert not alive(server_pid), "the launched server outlived the stage that launched it"
    assert not alive(worker_pid), "the server's worker outlived the stage that launched it"


def test_a_clean_exit_stops_server_and_watchdog(tmp_path):
    from draftsmith.serving.server import ManagedServer, free_port

    fake = tmp_path / "fake_server.py"
    fake.write_text(FAKE_SERVER)
    port = free_port("127.0.0.1")
    s = ManagedServer([sys.executable, str(fake), str(tmp_path / "pids"), str(port)],
                      host="127.0.0.1", port=port, log_file=tmp_path / "log", startup_timeout_s=60)
    with s:
        pids = [s.proc.pid, s.watchdog.pid, int((tmp_path / "pids").read_text())]
        assert all(alive(p) for p in pids)
    deadline = time.time() + 30
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.5)
    assert not any(alive(p) for p in pids)
