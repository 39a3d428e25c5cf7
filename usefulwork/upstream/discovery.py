"""Replica discovery: the replicas behind a pool, found at run time (``pools[].discovery``).

Behind Kubernetes, a pool's vLLM pods come and go with the autoscaler. Listing the Service's
ClusterIP as the pool's one replica would hide them behind kube-proxy: the picker, the health marks,
the ``/metrics`` scrapes and admission's per-replica limits would each see whichever pod a
connection happened to land on. A **source** says which replicas exist now; ``Fleet`` polls it every
``interval_s`` and reconciles the pool (``Fleet.reconcile``): a new replica is probed before it
takes traffic; a vanished one leaves the pick at once while its in-flight requests finish.

Two sources, one interface (``async urls() -> list[str]``):

- ``DnsSource``: every address of a host name, through the system resolver (``getaddrinfo``, so
  ``/etc/resolv.conf``, the cluster DNS and its search domains apply). A headless Service
  (``clusterIP: None``) answers with one address per pod; that is what Envoy's STRICT_DNS clusters
  and gRPC's ``dns:///`` balancer read too. A failed lookup raises, and the fleet keeps the replicas
  it last found (a DNS hiccup must not empty a pool).
- ``FileSource``: a file of base URLs, one per line, read again every interval (a mounted
  ConfigMap, or one written by a deploy tool). A file that cannot be read raises (replicas kept);
  a file that lists nothing means the pool has no replica.

The EndpointSlice API would give readiness and a watch instead of a poll, but needs the Kubernetes
client, a ServiceAccount with list/watch rights, and a cluster to test against, none of which this
project has. Both sources here are plain and are tested against the real resolver and real files.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from pathlib import Path
from typing import Protocol

from usefulwork.config import Discovery, replica_url


class Source(Protocol):
    def describe(self) -> str: ...

    async def urls(self) -> list[str]: ...


class DnsSource:
    def __init__(self, cfg: Discovery):
        self.host = cfg.dns or ""
        self.port = cfg.port
        self.scheme = cfg.scheme
        self.family = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}[cfg.family]

    def describe(self) -> str:
        return f"dns {self.host}:{self.port}"

    async def urls(self) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(self.host, self.port, family=self.family,
                                                             type=socket.SOCK_STREAM)
        addresses = sorted({info[4][0] for info in infos}, key=_address_key)
        return [self.url(a) for a in addresses]

    def url(self, address: str) -> str:
        host = f"[{address}]" if ":" in address else address
        return f"{self.scheme}://{host}:{self.port}"


def _address_key(a: str) -> tuple[int, int, str]:
    try:
        ip = ipaddress.ip_address(a.split("%", 1)[0])
    except ValueError:
        return (2, 0, a)
    return (ip.version, int(ip), a)


class FileSource:
    def __init__(self, cfg: Discovery):
        self.path = Path(cfg.file or "")

    def describe(self) -> str:
        return f"file {self.path}"

    async def urls(self) -> list[str]:
        text = self.path.read_text()  # a few lines: not worth a thread
        out = []
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                out.append(replica_url(line))
            except ValueError as exc:
                raise ValueError(f"{self.path}:{n}: {exc}") from None
        return list(dict.fromkeys(out))


def build_source(cfg: Discovery) -> Source:
    return DnsSource(cfg) if cfg.dns is not None else FileSource(cfg)
