"""What a config refers to outside itself, checked before the gateway starts: files it must read and
directories it must write, each problem naming the field.

A config can validate and still not start: a classifier head that is not there, a prefix picker's
tokenizer folder without ``tokenizer.json`` (the picker would silently hash characters instead), a
ledger, journal (when ``ledger.journal_dir`` is set) or recording directory that cannot be created. `usefulwork serve` exits 2 with those
errors before it binds anything (a traceback from deep inside the app's assembly before); `serve
--check` prints them as warnings, because they depend on where it runs (a deploy pipeline has neither
the pod's volumes nor the image's files), as it does for an unreachable Redis.
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
