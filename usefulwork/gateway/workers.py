"""`usefulwork serve --workers N`: N gateway processes on one port, supervised by the `serve` process.

The parent binds one listening socket per worker on the same address with ``SO_REUSEPORT`` (the
kernel spreads new connections over them by a hash of the client's address) and hands socket ``i``
to worker ``i`` (a fresh ``python -m usefulwork.gateway.workers`` process, the config passed as
JSON in its environment). The parent keeps its copy of every socket open, so connections that
arrive while a worker is being restarted wait in that socket's queue instead of being refused.

- **The embedded local fleet** is started once, by the parent, before the workers (serve.py).
- **SIGTERM / SIGINT** to the parent: SIGTERM to every worker; each drains like a single gateway
  (queued requests shed with Retry-After, running ones finished within the graceful timeout, the
  ledger flushed), then the parent exits 0 (1 if a worker did not exit cleanly).
- **A worker that dies** (any exit the parent did not ask for) is restarted on its socket. A worker
  that dies within ``CRASH_WINDOW_S`` of its start ``CRASH_LIMIT`` times in a row is a crash loop:
  the parent stops the others and exits 1.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time

from usefulwork.config import Config

ENV_CONFIG = "USEFULWORK_WORKER_CONFIG"
ENV_FD = "USEFULWORK_WORKER_FD"
ENV_INDEX = "USEFULWORK_WORKER_INDEX"
CRASH_WINDOW_S = 5.0
CRASH_LIMIT = 3
STOP_TIMEOUT_S = 60.0  # graceful drain (10 s) + ledger stop (shutdown_timeout_s) + margin
log = logging.getLogger("usefulwork.workers")


def bind_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """``n`` listening sockets on one address (SO_REUSEPORT); port 0 picks one free port for all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind((host, port))
            port = s.getsockname()[1]
            s.listen(2048)
            s.set_inheritable(True)
            socks.append(s)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


class Supervisor:
    """Starts, restarts and stops the worker processes (see the module doc)."""

    def __init__(self, cfg: Config, log_level: str, say=print):
        self.cfg = cfg
        self.log_level = log_level
        self.say = say
        self.socks = bind_sockets(cfg.listen.host, cfg.listen.port, cfg.listen.workers)
        self.port = self.socks[0].getsockname()[1]
        self.procs: list[subprocess.Popen | None] = [None] * len(self.socks)
        self.started: list[float] = [0.0] * len(self.socks)
        self.crashes: list[int] = [0] * len(self.socks)
        self._stop = False
        cfg_json = cfg.model_copy(update={"listen": cfg.listen.model_copy(update={"port": self.port})}).model_dump_json()
        self._env = {**os.environ, ENV_CONFIG: cfg_json}

    def _spawn(self, i: int) -> None:
        fd = self.socks[i].fileno()
        env = {**self._env, ENV_FD: str(fd), ENV_INDEX: str(i)}
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "usefulwork.gateway.workers", self.log_level],
                                         pass_fds=(fd,), env=env)
        self.started[i] = time.monotonic()

    def _on_signal(self, signum, frame) -> None:
        self._stop = True

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i in range(len(self.socks)):
                self._spawn(i)
            self.say(f"gateway listening on http://{self.cfg.listen.host}:{self.port}/v1  "
                     f"({len(self.socks)} workers; models: {', '.join(self.cfg.model_names)})")
            rc = self._watch()
            return max(rc, self._stop_all())
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for s in self.socks:
                s.close()

    def _watch(self) -> int:
        while not self._stop:
            time.sleep(0.2)
            for i, p in enumerate(self.procs):
                if self._stop or p is None or p.poll() is None:
                    continue
                quick = time.monotonic() - self.started[i] < CRASH_WINDOW_S
                self.crashes[i] = self.crashes[i] + 1 if quick else 1
                if self.crashes[i] >= CRASH_LIMIT:
                    self.say(f"worker {i} exited with {p.returncode} {CRASH_LIMIT} times within "
                             f"{CRASH_WINDOW_S:.0f} s of starting: stopping")
                    return 1
                self.say(f"worker {i} (pid {p.pid}) exited with {p.returncode}: restarting it")
                self._spawn(i)
        return 0

    def _stop_all(self) -> int:
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        rc = 0
        for p in live:
            try:
                code = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                p.kill()
                code = p.wait()
            rc = max(rc, 0 if code == 0 else 1)
        return rc


def worker_main(log_level: str) -> int:
    """One worker: the config from the environment, serve on the inherited socket until SIGTERM."""
    from usefulwork.gateway.serve import _terminate, run_gateway, setup_logging

    for sig in (signal.SIGTERM, signal.SIGINT):  # uvicorn re-raises the signal after its graceful stop: exit 0
        signal.signal(sig, _terminate)
    setup_logging(log_level)
    cfg = Config.model_validate_json(os.environ[ENV_CONFIG])
    sock = socket.socket(fileno=int(os.environ[ENV_FD]))
    run_gateway(cfg, log_level, sockets=[sock], quiet=True)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1] if len(sys.argv) > 1 else "warning"))
