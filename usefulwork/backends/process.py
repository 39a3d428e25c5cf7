"""A server subprocess: start it in its own process group, wait until an HTTP path answers 200,
stop the whole group. The shared base of LocalVLLM (real vLLM), SimProcess (the simulator) and
the loadtest's gateway process, so all of them fail the same clear way and never leave strays.

A server is in a session of its own (a Ctrl-C in the terminal reaches the parent only, which then
stops it in order), so the kernel would not end it with its parent: a ``usefulwork serve`` that was
SIGKILLed or OOM-killed left its vLLM running, holding its port and memory. On Linux each server is
therefore started with ``PR_SET_PDEATHSIG`` (SIGTERM when its parent dies). That signal follows the
*thread* that forked the child, not the process, so every server is forked by one long-lived
launcher thread (``_Launcher``): a server started from a short-lived thread (``asyncio.to_thread``, an
executor) would otherwise be sent SIGTERM when that thread ended.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import httpx

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


class _Launcher:
    """One daemon thread that forks every managed server, for the life of this process."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._prctl = _prctl()  # bound before any fork: the child only calls it

    def popen(self, *args, **kwargs) -> subprocess.Popen:
        if self._prctl is None:
            return subprocess.Popen(*args, **kwargs)
        parent, prctl = os.getpid(), self._prctl

        def tie_to_parent() -> None:  # in the child, between fork and exec
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the parent died before the line above: nobody will signal us
                os._exit(1)

        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="usefulwork-launcher", daemon=True)
                self._thread.start()
        done: Future = Future()
        self._jobs.put((done, args, {**kwargs, "preexec_fn": tie_to_parent}))
        return done.result()

    def _run(self) -> None:
        while True:
            done, args, kwargs = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                done.set_exception(exc)


_launcher = _Launcher()


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
        try:
            self.proc = _launcher.popen(self.command(), env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()  # the child holds its own copy
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
