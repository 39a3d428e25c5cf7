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
- **SIGHUP** to the parent (with a config file), or a change to the file it watches
  (``reload.watch_interval_s``): the parent reloads the file (gateway/reload.py); if it
  loads, the parent keeps its tenants, keys and access for the workers it starts from then on, and
  passes SIGHUP to every worker, which reloads the file itself. A file that does not load is said
  once, by the parent, and no worker is signalled. A worker that SIGHUP reaches while it is still
  starting (before its handler is installed) dies of it, having served nothing, and is started again
  with the reloaded config: not counted as a crash.
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
from usefulwork.gateway.reload import Reloader

ENV_CONFIG = "USEFULWORK_WORKER_CONFIG"
ENV_FD = "USEFULWORK_WORKER_FD"
ENV_INDEX = "USEFULWORK_WORKER_INDEX"
ENV_LOADED = "USEFULWORK_WORKER_LOADED"  # the config file as loaded, before the command line's overrides
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

    def __init__(self, cfg: Config, log_level: str, say=print, loaded: Config | None = None):
        self.cfg = cfg
        self.log_level = log_level
        self.say = say
        self.socks = bind_sockets(cfg.listen.host, cfg.listen.port, cfg.listen.workers)
        self.port = self.socks[0].getsockname()[1]
        self.procs: list[subprocess.Popen | None] = [None] * len(self.socks)
        self.started: list[float] = [0.0] * len(self.socks)
        self.crashes: list[int] = [0] * len(self.socks)
        self._stop = self._hup = False
        running = cfg.model_copy(update={"listen": cfg.listen.model_copy(update={"port": self.port})})
        self.reloader = Reloader(running, apply=lambda new: None, loaded=loaded)
        self._env = self._worker_env()

    def _worker_env(self) -> dict[str, str]:
        r = self.reloader
        return {**os.environ, ENV_CONFIG: r.running.model_dump_json(), ENV_LOADED: r.loaded.model_dump_json()}  # type: ignore[union-attr]

    def _spawn(self, i: int) -> None:
        fd = self.socks[i].fileno()
        env = {**self._env, ENV_FD: str(fd), ENV_INDEX: str(i)}
        self.procs[i] = subprocess.Popen([sys.executable, "-m", "usefulwork.gateway.workers", self.log_level],
                                         pass_fds=(fd,), env=env)
        self.started[i] = time.monotonic()

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGHUP:
            self._hup = True
        else:
            self._stop = True

    def run(self) -> int:
        handled = (signal.SIGTERM, signal.SIGINT) + ((signal.SIGHUP,) if self.reloader.source is not None else ())
        old = {s: signal.signal(s, self._on_signal) for s in handled}
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

    def _reload(self) -> None:
        self._hup = False
        r = self.reloader.reload()  # (a file that does not load is logged there, naming the field)
        if r is None:
            return
        self._env = self._worker_env()
        live = [p for p in self.procs if p is not None and p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGHUP)
        self.say(f"config reloaded from {r.config.source}: {r.summary()} (passed to {len(live)} workers)")

    def _watch(self) -> int:
        every, looked = self.reloader.watch_interval_s, time.monotonic()
        while not self._stop:
            time.sleep(0.2)
            if every is not None and time.monotonic() - looked >= every:
                looked = time.monotonic()
                self._hup = self._hup or self.reloader.changed_on_disk()
            if self._hup:
                self._reload()
            for i, p in enumerate(self.procs):
                if self._stop or p is None or p.poll() is None:
                    continue
                if p.returncode == -signal.SIGHUP:  # reached by a reload while starting: started again
                    self.say(f"worker {i} (pid {p.pid}) was still starting when the reload came: starting it again")
                    self._spawn(i)
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
    loaded = Config.model_validate_json(os.environ[ENV_LOADED]) if ENV_LOADED in os.environ else None
    sock = socket.socket(fileno=int(os.environ[ENV_FD]))
    run_gateway(cfg, log_level, sockets=[sock], quiet=True, loaded=loaded)
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1] if len(sys.argv) > 1 else "warning"))
