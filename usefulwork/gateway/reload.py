"""Reload who may call, on SIGHUP: tenants (keys, limits, budgets, priority, weight, degrade, enabled, models),
``auth.api_keys``, and ``access`` (admin keys, the metrics scrape token), from the config file the
gateway was started with, without a restart and without dropping a request.

A platform team rotates a key, adds a tenant, raises a limit or disables a tenant far more often than
it changes its pools, and a restart drains the queue (queued requests are shed with Retry-After).
So ``kill -HUP <pid>`` (``serve --workers N``: the parent's pid, which passes it on) reads the file
again, validates it as at start, and swaps the gateway's one key -> tenant table (``Tenants.reload``)
in one synchronous step: a request identified before the swap keeps its tenant, every later one gets
the new table. Limits are read per request from that table, so a changed rpm, tpm or budget applies
to the next request; counters (token buckets, the day's spend, fair-share tokens) are kept.

With ``reload.watch_interval_s`` the gateway (``--workers N``: the parent) also looks at the file that often
and reloads when its modification time, size or inode changed and then held still for one more look,
as when Kubernetes updates a mounted ConfigMap (it swaps a symlink, atomically) or an editor has finished
writing. A reload never turns key checks off: a file with no key left (tenant, legacy or admin), as a
truncated one is for a moment, is refused while keys were configured (a restart can do it).

Everything else (pools, filters, admission, SLO, ...) is read once at start: a reload that finds one
of those sections changed applies the live ones and says which need a restart. A file that does not
load (bad YAML, a field that does not validate, tenant limits under ``--workers N`` without a shared
Redis) changes nothing: the gateway keeps serving the tables it has and logs the error naming the
field. Outcomes are counted (``usefulwork.config.reloads``, by result) and the last one is a gauge
(``usefulwork.config.last_reload_successful``), as Prometheus does for its own config.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from usefulwork.config import Config, ConfigError, load
from usefulwork.gateway.tenants import Tenants

LIVE = ("tenants", "auth", "access")  # the sections a reload applies
log = logging.getLogger("usefulwork.reload")


@dataclass
class Reloaded:
    config: Config  # as loaded from the file
    live: list[str]  # live sections that changed (applied)
    restart: list[str]  # other sections that changed (not applied: a restart would)

    def summary(self) -> str:
        said = f"applied {', '.join(self.live)}" if self.live else "tenants, keys and access unchanged"
        if self.restart:
            said += f"; restart to apply: {', '.join(self.restart)} (changed, read only at start)"
        return said


def shared_limits_problem(cfg: Config) -> str | None:
    """Tenant limits that several worker processes would each grant in full: the error naming the field."""
    n = cfg.listen.workers
    if n > 1 and "admission" in cfg.filters and cfg.admission.redis_url is None and any(
            t.limited for t in cfg.tenants.values()):
        return (f"admission.redis_url: --workers {n} with tenant rpm/tpm/budget limits needs a shared Redis "
                f"(per-process limits would let each of the {n} workers grant the full limit)")
    return None


@dataclass
class Reloader:
    """Reads the config file again and hands its live sections to ``apply``.

    ``running``: the config this process serves (after the command line's overrides and the embedded
    pool); ``loaded``: as the file gave it at start (what a reload compares with; default ``running``)."""

    running: Config
    apply: Callable[[Config], None]
    loaded: Config | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"ok": 0, "error": 0})
    last_ok: bool = True
    last_error: str | None = None
    last_success_at: float = field(default_factory=time.time)  # the start counts as a load

    def __post_init__(self) -> None:
        if self.loaded is None:
            self.loaded = self.running
        self._seen, self._pending = self._signature(), None

    @property
    def source(self) -> str | None:
        """The file to read again (None: the built-in defaults and the environment)."""
        return None if self.running.source == "<defaults>" else self.running.source

    @property
    def watch_interval_s(self) -> float | None:
        """How often to look at the file for a change (None: SIGHUP only, or no file)."""
        return self.running.reload.watch_interval_s if self.source is not None else None

    def _signature(self) -> tuple[int, int, int] | None:
        if self.source is None:
            return None
        try:
            st = os.stat(self.source)  # follows symlinks: a ConfigMap's swapped ..data link gives a new inode
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def changed_on_disk(self) -> bool:
        """The file differs from when it was last read, and has stayed so since the previous look: a file
        being written (an editor truncates, then writes) is read once it has settled. A file that cannot
        be read now, as in the middle of a replacement, has not changed yet."""
        sig = self._signature()
        if sig is None or sig == self._seen:
            self._pending = None
            return False
        settled, self._pending = sig == self._pending, sig
        return settled

    def check(self) -> Reloaded:
        """Load and validate the file; raises ConfigError naming the field. Applies nothing."""
        new = load(self.source)
        changed = [n for n in Config.model_fields if n != "source" and getattr(new, n) != getattr(self.loaded, n)]
        would_run = self.running.model_copy(update={n: getattr(new, n) for n in LIVE})
        if (problem := shared_limits_problem(would_run)) is not None:
            raise ConfigError(f"{new.source}: {problem}")
        if Tenants(self.loaded).auth_enabled and not Tenants(new).auth_enabled:  # type: ignore[arg-type]
            # (an empty or cut file, as an editor that truncates before it writes leaves it for a moment,
            # would otherwise let every caller in)
            raise ConfigError(f"{new.source}: tenants, auth.api_keys, access.admin_key_hashes: no key left, so every "
                              "caller would be let in; a reload never turns key checks off (a restart does)")
        return Reloaded(new, [n for n in changed if n in LIVE], [n for n in changed if n not in LIVE])

    def reload(self) -> Reloaded | None:
        """Check, then apply the live sections; None (and nothing changed) when the file does not load."""
        self._seen, self._pending = self._signature(), None  # (a file that failed is read again once it changes again)
        try:
            r = self.check()
        except ConfigError as exc:
            self.counts["error"] += 1
            self.last_ok, self.last_error = False, str(exc)
            log.error("config reload failed, still serving the previous tenants and keys: %s", exc)
            return None
        live = {n: getattr(r.config, n) for n in LIVE}
        self.apply(r.config)
        self.running = self.running.model_copy(update=live)
        self.loaded = self.loaded.model_copy(update=live)  # type: ignore[union-attr]
        self.counts["ok"] += 1
        self.last_ok, self.last_error, self.last_success_at = True, None, time.time()
        return r

    def status(self) -> dict[str, Any]:
        """For the admin's /readyz detail."""
        return {"source": self.running.source, "reloads": dict(self.counts), "last_reload_successful": self.last_ok,
                "last_success_at": self.last_success_at, "last_error": self.last_error}

    def instrument(self, meter: Any) -> None:
        """The OTel instruments (observable: read at collection, nothing per request)."""
        from opentelemetry.metrics import Observation  # noqa: PLC0415

        meter.create_observable_counter(
            "usefulwork.config.reloads", [lambda _o: [Observation(v, {"result": k}) for k, v in self.counts.items()]],
            unit="{reload}", description="Config reloads (SIGHUP), by result: ok | error")
        meter.create_observable_gauge(
            "usefulwork.config.last_reload_successful", [lambda _o: [Observation(int(self.last_ok))]],
            unit="1", description="1 when the last config reload applied (or none was asked for), 0 when it failed")
