"""What a config refers to outside itself, checked before the gateway starts: files it must read and
directories it must write, each problem naming the field.

A config can validate and still not start: a classifier head that is not there, a prefix picker's
tokenizer folder without ``tokenizer.json`` (the picker would silently hash characters instead), a
ledger, journal (when ``ledger.journal_dir`` is set) or recording directory that cannot be created.
`usefulwork serve` exits 2 with those errors before it binds anything (a traceback from deep inside the
app's assembly before); `serve --check` prints them as warnings, because they depend on where it runs (a
deploy pipeline has neither the pod's volumes nor the image's files), as it does for an unreachable Redis.

Each Redis the config names is pinged once too (``redis_reach``). ``scale_out.redis_url`` unreachable
stops `serve` (workers and replicas could not act as one gateway); the others fail open by design
(limits per process, records held, cache lookups missed), so `serve` starts and says so at once,
naming the field, rather than on the first request that needs it.
"""

from __future__ import annotations

import os
from pathlib import Path

from usefulwork.config import Config
from usefulwork.gateway.accounting.journal import journal_dir_for
from usefulwork.upstream.pickers import tokenizer_problem


def problems(cfg: Config, create: bool = True) -> list[str]:
    """Each problem as ``field: what is wrong`` (empty: nothing found). ``create``: make the directories
    to write (as serving would); else only look whether they could be made."""
    out: list[str] = []
    for i, vm in enumerate(cfg.routing.virtual_models):
        if vm.classifier.head_path is not None and vm.router == "classifier":
            from usefulwork.routers.classifier import Head

            try:
                Head.load(vm.classifier.head_path)
            except ValueError as exc:
                out.append(f"routing.virtual_models.{i}.classifier.head_path: {exc}")
    for pool in cfg.pools:
        picker = cfg.routing.picker_for(pool.name)
        if picker.kind in ("prefix", "precise-prefix") and (why := tokenizer_problem(picker.tokenizer)) is not None:
            where = f"routing.pickers.{pool.name}" if pool.name in cfg.routing.pickers else "routing.default_picker"
            out.append(f"{where}.tokenizer: {why}")
    for field, directory in _dirs(cfg):
        if (why := _unwritable(directory, create)) is not None:
            out.append(f"{field}: {why}")
    return list(dict.fromkeys(out))  # (a default picker shared by several pools: said once)


def redis_uses(cfg: Config) -> list[tuple[str, str, str]]:
    """(field, URL, what the gateway does while it does not answer) for each Redis it will use; the
    first, when set, is ``scale_out.redis_url`` (no fallback: serve exits 2)."""
    out = []
    if cfg.scale_out.redis_url:
        out.append(("scale_out.redis_url", cfg.scale_out.redis_url, ""))
    adm = cfg.admission
    if "admission" in cfg.filters and adm.redis_url:
        out.append(("admission.redis_url", adm.redis_url,
                    "limited tenants get 503 until it answers (admission.on_redis_down: closed)"
                    if adm.on_redis_down == "closed" else "tenant limits are per process until it answers"))
    if cfg.ledger.redis_url:
        out.append(("ledger.redis_url", cfg.ledger.redis_url,
                    "the ledger holds its records for the Redis Stream (and journals them) until it answers"))
    if "cache" in cfg.filters and cfg.cache.redis_url:
        out.append(("cache.redis_url", cfg.cache.redis_url, "every cache lookup misses until it answers"))
    return out


def redis_reach(cfg: Config, scale_out: bool | None = None,
                timeout_s: float = 2.0) -> list[tuple[str, str | None, str]]:
    """(field, why it cannot be reached from here or None, what the gateway does meanwhile) for each of
    ``redis_uses`` (``scale_out``: that one alone; False: all but it): one ping per distinct URL."""
    import redis  # noqa: PLC0415

    seen: dict[str, str | None] = {}
    out = []
    for field, url, meanwhile in redis_uses(cfg):
        if scale_out is not None and (field == "scale_out.redis_url") != scale_out:
            continue
        if url not in seen:
            try:
                redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s).ping()
                seen[url] = None
            except (redis.RedisError, ValueError) as exc:
                seen[url] = f"Redis at {no_password(url)} cannot be reached: {exc}"
        out.append((field, seen[url], meanwhile))
    return out


def no_password(url: str) -> str:
    """``url`` with any password replaced by ``***`` (redis://user:secret@host -> redis://user:***@host)."""
    from urllib.parse import urlsplit, urlunsplit  # noqa: PLC0415

    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        user = f"{parts.username}:***@" if parts.username else ":***@"
        return urlunsplit(parts._replace(netloc=user + parts.netloc.rpartition("@")[2]))
    except ValueError:
        return "<unparseable URL>"


def _dirs(cfg: Config) -> list[tuple[str, Path]]:
    """(field, directory) the gateway will write into."""
    led = cfg.ledger
    out = []
    if led.jsonl_path:
        out.append(("ledger.jsonl_path", Path(led.jsonl_path).parent))
    if led.journal_dir and (journal := journal_dir_for(led)) is not None:
        # (only one asked for: where the default cannot be written, the ledger serves on without its
        # journal and says so at start, as ``Ledger.start`` does for any journal that will not open)
        out.append(("ledger.journal_dir", journal))
    if "record" in cfg.filters:
        out.append(("record.dir", Path(cfg.record.dir)))
    return out


def _unwritable(directory: Path, create: bool) -> str | None:
    """Why files cannot be written in ``directory`` (None: they can)."""
    if create:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return f"cannot create {directory}: {exc.strerror}"
        return None if os.access(directory, os.W_OK | os.X_OK) else f"{directory} is not writable"
    probe = directory
    while not probe.exists():  # the nearest part that exists must let the rest be made
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"cannot create {directory}: {probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{directory} cannot be {'written' if probe == directory else 'created'} ({probe} is not writable)"
    return None
