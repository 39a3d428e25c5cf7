"""A server subprocess: start it in its own process group, wait until an HTTP path answers 200,
stop the whole group. The shared base of LocalVLLM (real vLLM), SimProcess (the simulator) and
the loadtest's gateway process, so all of them fail the same clear way and never leave strays.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import httpx


class ManagedProcess:
    """Subclasses provide ``command()`` and ``base_url``; they may override the class settings."""

    name = "server"
    ready_path = "/health"
    poll_s = 0.2
    stop_timeout_s = 30.0
    killed = False  # the last stop had to SIGKILL (what a clean stop would have written may be lost)
    proc: subprocess.Popen | None
    log_path: Path | None

    @property
    def base_url(self) -> str:
        raise NotImplementedError

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self):
        if self.proc is not None and self.proc.poll() is None:
            return self
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 60.0, progress: Callable[[str], None] | None = None) -> None:
        """Block until ``ready_path`` answers 200; raise with the log tail if the process exits."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        last_note = t0
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} during start-up\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.base_url + self.ready_path, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if progress and time.monotonic() - last_note >= 10:
                last_note = time.monotonic()
                progress(f"waiting for {self.name} on {self.base_url} ... {last_note - t0:.0f}s")
            time.sleep(self.poll_s)
        raise TimeoutError(f"{self.name} did not become ready in {timeout_s:.0f}s\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        if not self.log_path or not Path(self.log_path).exists():
            return "(no log)"
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM the process group, SIGKILL it if it has not exited in time."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            self.killed = True
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)

    def __enter__(self):
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
