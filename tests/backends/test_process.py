"""A managed server ends with the process that started it, also when that process is SIGKILLed.

Real processes and real signals: a parent Python process starts a managed child from a short-lived
thread (as ``asyncio.to_thread`` would), then is killed; the child must not outlive it, and must not
be signalled when the starting thread alone ends.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PARENT = textwrap.dedent("""
    import sys, threading, time
    from usefulwork.backends.process import ManagedProcess

    class Sleeper(ManagedProcess):
        name = "sleeper"
        proc = None
        log_path = None
        base_url = "http://127.0.0.1:9"

        def command(self):
            return [sys.executable, "-c", "import time; time.sleep(600)"]

    s = Sleeper()
    t = threading.Thread(target=s.start)
    t.start()
    t.join()  # the thread that asked for the child is gone
    print(s.proc.pid, flush=True)
    if sys.argv[1] == "stop":
        time.sleep(1.0)
        s.stop(5)
        print(s.proc.returncode, flush=True)
    time.sleep(600)
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")  # a zombie has ended; its new parent may not reap it at once


def _parent(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    parent = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=env)
    return parent, int(parent.stdout.readline())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_managed_server_dies_with_a_sigkilled_parent_but_not_with_the_thread_that_started_it(tmp_path: Path):
    parent, child = _parent(tmp_path, "kill")
    try:
        time.sleep(1.0)
        assert _alive(child), "the child was signalled when the thread that started it ended"
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the managed child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_stop_still_ends_the_server_in_order(tmp_path: Path):
    parent, child = _parent(tmp_path, "stop")
    try:
        assert int(parent.stdout.readline()) == -signal.SIGTERM
        assert not _alive(child)
    finally:
        parent.kill()
        parent.wait(10)
