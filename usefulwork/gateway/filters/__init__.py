"""The filters a config may name in ``filters:``, in the order they run.

Each entry maps a name to ``"module:factory"``; the factory is called once per gateway process
as ``factory(services) -> Filter`` (``usefulwork.gateway.pipeline.Services``). Modules are imported
only when a config names them, so an unused filter costs nothing (not even its imports).

Add a filter: write one module with its class and a test with a fake ``next``, then add one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from usefulwork.gateway.pipeline import Filter, Services

FILTERS: dict[str, str] = {
    "noop": "usefulwork.gateway.filters.noop:NoopFilter",
    "cache": "usefulwork.caches.filter:CacheFilter",
    "router": "usefulwork.gateway.filters.router:RouterFilter",
    "admission": "usefulwork.gateway.admission.filter:AdmissionFilter",
    "record": "usefulwork.gateway.recording:RecordFilter",
}


def build_filters(names: list[str], services: Services) -> list[Filter]:
    out = []
    for name in names:
        module, _, attr = FILTERS[name].partition(":")
        factory = getattr(importlib.import_module(module), attr)
        out.append(factory(services))
    return out
