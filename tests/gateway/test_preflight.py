"""Preflight's journal rule: a journal directory the config asks for must be writable (serve exits 2 on
it); the default one, where it cannot be made, is left to the ledger, which serves on without it and
says so at start (as for any journal that will not open)."""

from __future__ import annotations

from usefulwork.config import Config
from usefulwork.gateway.preflight import problems


def test_only_a_journal_dir_asked_for_must_be_writable(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("USEFULWORK_CACHE_DIR", str(blocker))  # the default journal (a Redis-only ledger) lies under it
    pools = [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:9"]}]
    default = Config.model_validate({"pools": pools, "ledger": {"redis_url": "redis://127.0.0.1:9/0"}})
    assert problems(default) == [] and problems(default, create=False) == []
    asked = Config.model_validate({"pools": pools, "ledger": {"redis_url": "redis://127.0.0.1:9/0",
                                                              "journal_dir": f"{blocker}/journal"}})
    for create in (True, False):
        (found,) = problems(asked, create=create)
        assert found.startswith(f"ledger.journal_dir: cannot create {blocker}/journal"), found
    off = Config.model_validate({"pools": pools, "ledger": {"redis_url": "redis://127.0.0.1:9/0", "journal": False,
                                                            "journal_dir": f"{blocker}/journal"}})
    assert problems(off) == []  # (the journal is off: nothing to write)
