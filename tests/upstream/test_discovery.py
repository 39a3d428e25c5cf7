"""Replica discovery: the sources against the real resolver and real files, and the fleet's reconcile."""

from __future__ import annotations

import asyncio
import socket

import pytest

from usefulwork.config import ConfigError, Discovery, from_mapping
from usefulwork.upstream.discovery import DnsSource, FileSource
from usefulwork.upstream.fleet import Fleet
from usefulwork.upstream.pickers import build_pickers


async def test_dns_source_reads_every_address_through_the_system_resolver():
    src = DnsSource(Discovery(dns="localhost", port=8123))
    assert "http://127.0.0.1:8123" in await src.urls()
    v6 = DnsSource(Discovery(dns="::1", port=9000, scheme="https"))  # numeric: getaddrinfo answers it as given
    assert await v6.urls() == ["https://[::1]:9000"]
    v4_only = DnsSource(Discovery(dns="localhost", port=8123, family="ipv4"))  # dual-stack: one address per pod
    assert all(":" not in u.split("//")[1].rsplit(":", 1)[0] for u in await v4_only.urls())
    with pytest.raises(socket.gaierror):
        await DnsSource(Discovery(dns="127.0.0.1", family="ipv6")).urls()  # an IPv4 literal has no IPv6 address


async def test_dns_source_raises_for_a_name_that_does_not_resolve():
    with pytest.raises(socket.gaierror):
        await DnsSource(Discovery(dns="no-such-replica.invalid")).urls()


async def test_file_source_reads_urls_comments_and_blank_lines(tmp_path):
    f = tmp_path / "replicas.txt"
    f.write_text("# pool llama\nhttp://10.0.0.5:8000/v1/\n\n  http://10.0.0.6:8000  # the second\nhttp://10.0.0.5:8000\n")
    assert await FileSource(Discovery(file=str(f))).urls() == ["http://10.0.0.5:8000", "http://10.0.0.6:8000"]
    f.write_text("")
    assert await FileSource(Discovery(file=str(f))).urls() == []
    f.write_text("http://ok:1\nftp://nope:2\n")
    with pytest.raises(ValueError, match=r"replicas.txt:2: .*http:// or https://"):
        await FileSource(Discovery(file=str(f))).urls()
    with pytest.raises(FileNotFoundError):
        await FileSource(Discovery(file=str(tmp_path / "missing"))).urls()


def test_config_needs_replicas_or_discovery_and_one_source():
    base = {"name": "p", "models": ["m"]}
    with pytest.raises(ConfigError, match="give replicas, discovery, or both"):
        from_mapping({"pools": [base]}, environ={})
    with pytest.raises(ConfigError, match="exactly one of dns or file"):
        from_mapping({"pools": [{**base, "discovery": {"dns": "a", "file": "b"}}]}, environ={})
    with pytest.raises(ConfigError, match="exactly one of dns or file"):
        from_mapping({"pools": [{**base, "discovery": {}}]}, environ={})
    cfg = from_mapping({"pools": [{**base, "discovery": {"dns": "vllm.ns.svc.cluster.local"},
                                   "gpu": {"usd_per_hour": 2.0, "per_replica": 2}}]}, environ={})
    assert cfg.pools[0].usd_per_hour_for(3) == 12.0 and cfg.pools[0].usd_per_hour == 0.0


async def test_reconcile_adds_probes_and_removes_replicas_and_tells_the_listeners(tmp_path):
    """Static replicas stay; a discovered one is unhealthy until probed; a removed one leaves the list (a
    reader holding the old list keeps it whole), closes its idle connections, and leaves the picker's index."""
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "replicas": ["http://127.0.0.1:1"],
                                   "discovery": {"file": str(tmp_path / "r.txt")}}],
                        "routing": {"default_picker": {"kind": "prefix"}}}, environ={})
    fleet = Fleet(cfg)
    pickers = build_pickers(cfg, fleet)
    seen = []
    fleet.on_change(lambda pool, added, removed: seen.append(([r.url for r in added], [r.url for r in removed])))
    pool = fleet.pools["p"]
    try:
        added, removed = fleet.reconcile(pool, ["http://127.0.0.1:2", "http://127.0.0.1:1", "http://127.0.0.1:2"])
        assert [r.url for r in added] == ["http://127.0.0.1:2"] and not removed  # the static one is not doubled
        assert [r.url for r in pool.replicas] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
        new = pool.replicas[1]
        assert new.discovered and not new.healthy  # no traffic before its first probe passes
        await asyncio.sleep(0.2)  # that probe ran (nothing listens on port 2): still down
        assert not new.healthy and new.down_reason.startswith("health check failed")
        pickers["p"].index[new.url] = object()
        lease = fleet.lease(new)  # a request still running on it when it is removed
        before = pool.replicas
        assert fleet.reconcile(pool, ["http://127.0.0.1:2"]) == ([], [])  # the static one is never removed
        fleet.reconcile(pool, [])
        assert [r.url for r in pool.replicas] == ["http://127.0.0.1:1"]
        assert len(before) == 2 and new.removed and new.http.retired and new.url not in pickers["p"].index
        assert seen == [(["http://127.0.0.1:2"], []), ([], ["http://127.0.0.1:2"])]
        assert fleet.any_inflight()  # the ledger's settlement still waits for it
        lease.release()
        assert not fleet.any_inflight()
    finally:
        await fleet.stop()


async def test_a_failed_read_keeps_the_replicas_last_found(tmp_path):
    f = tmp_path / "r.txt"
    f.write_text("http://127.0.0.1:7\n")
    cfg = from_mapping({"pools": [{"name": "p", "models": ["m"], "discovery": {"file": str(f)}}]}, environ={})
    fleet = Fleet(cfg)
    pool = fleet.pools["p"]
    try:
        assert await fleet.discover_once(pool)
        f.unlink()
        assert not await fleet.discover_once(pool) and not await fleet.discover_once(pool)
        assert [r.url for r in pool.replicas] == ["http://127.0.0.1:7"] and pool.discovery_errors == 2
        f.write_text("")
        assert await fleet.discover_once(pool)  # an empty file is an answer: no replica
        assert pool.replicas == [] and pool.discovery_errors == 0 and not fleet.ready()
    finally:
        await fleet.stop()
