"""Per-request accounting: the ledger, cost, and the stats/dashboard routes.

PLACEHOLDER owned by the accounting work (issue 4): ``build`` returns the bundle the gateway wires in.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.routing import BaseRoute

from usefulwork.backends.fleet import Fleet
from usefulwork.config import Config
from usefulwork.gateway.context import Accountant, NullAccountant


@dataclass
class AccountingBundle:
    accountant: Accountant
    routes: list[BaseRoute] = field(default_factory=list)


def build(cfg: Config, fleet: Fleet) -> AccountingBundle:
    return AccountingBundle(accountant=NullAccountant())
