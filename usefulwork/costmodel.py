"""`usefulwork cost`: the inference cost model as a calculator.

The master formula (the seed lesson's): a GPU fleet costs the same per hour whether it is busy or
not, so ::

    $ per 1M tokens = $/hour / (tokens/s x 3600) x 1e6

and everything else follows from it: the tokens/s a target price needs, the monthly volume at
which an always-on self-hosted fleet beats a pay-per-token API, and the same figures at on-demand,
reserved and spot prices. Inputs come from flags, or from a `usefulwork loadtest` result file
(measured output tokens/s and the fleet's $/hour); flags override the file.

    usefulwork cost --usd-per-hour 3.5 --tokens-per-s 1000
    usefulwork cost --gpu-usd-per-hour 2.0 --gpus 4 --target-usd-per-1m 0.5 --api-usd-per-1m 1.2
    usefulwork cost --from-result loadtest-results/steady/results.json --run optimized --json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HOURS_PER_MONTH = 730.0  # 365 x 24 / 12
# Typical cloud discounts off on-demand (override with the flags): 1-year reserved about 40 %,
# spot / preemptible about 65 %. They are inputs to the model, not facts about any provider.
RESERVED_DISCOUNT = 0.40
SPOT_DISCOUNT = 0.65


class CostModelError(ValueError):
    pass


# -- the model (pure functions) --
def usd_per_1m_tokens(usd_per_hour: float, tokens_per_s: float) -> float:
    if tokens_per_s <= 0:
        raise CostModelError("tokens/s must be > 0")
    return usd_per_hour / (tokens_per_s * 3600.0) * 1e6


def tokens_per_s_for(usd_per_hour: float, target_usd_per_1m: float) -> float:
    """Throughput at which the fleet's tokens cost ``target_usd_per_1m``."""
    if target_usd_per_1m <= 0:
        raise CostModelError("the target $ per 1M tokens must be > 0")
    return usd_per_hour / (target_usd_per_1m / 1e6) / 3600.0


def monthly_cost(usd_per_hour: float, hours_per_month: float = HOURS_PER_MONTH) -> float:
    return usd_per_hour * hours_per_month


def monthly_capacity_tokens(tokens_per_s: float, utilization: float = 1.0,
                            hours_per_month: float = HOURS_PER_MONTH) -> float:
    return tokens_per_s * utilization * 3600.0 * hours_per_month


def breakeven_tokens_per_month(usd_per_hour: float, api_usd_per_1m: float,
                               hours_per_month: float = HOURS_PER_MONTH) -> float:
    """Monthly volume above which the always-on fleet is cheaper than paying the API per token."""
    if api_usd_per_1m <= 0:
        raise CostModelError("the API price per 1M tokens must be > 0")
    return monthly_cost(usd_per_hour, hours_per_month) / api_usd_per_1m * 1e6


@dataclass
class Tier:
    name: str
    usd_per_hour: float
    usd_per_month: float
    usd_per_1m_tokens: float | None
    tokens_per_s_for_target: float | None
    breakeven_tokens_per_month: float | None
    breakeven_within_capacity: bool | None


@dataclass
class Inputs:
    usd_per_hour: float
    tokens_per_s: float | None = None
    target_usd_per_1m: float | None = None
    api_usd_per_1m: float | None = None
    utilization: float = 1.0
    hours_per_month: float = HOURS_PER_MONTH
    reserved_usd_per_hour: float | None = None
    spot_usd_per_hour: float | None = None
    source: str = "flags"


def evaluate(inp: Inputs) -> dict[str, Any]:
    """Every figure for every pricing tier."""
    if inp.usd_per_hour <= 0:
        raise CostModelError("$/hour must be > 0 (give --usd-per-hour, or --gpu-usd-per-hour and --gpus)")
    if not 0 < inp.utilization <= 1:
        raise CostModelError("utilization must be in (0, 1]")
    prices = {
        "on-demand": inp.usd_per_hour,
        "reserved": inp.reserved_usd_per_hour if inp.reserved_usd_per_hour is not None
        else inp.usd_per_hour * (1 - RESERVED_DISCOUNT),
        "spot": inp.spot_usd_per_hour if inp.spot_usd_per_hour is not None else inp.usd_per_hour * (1 - SPOT_DISCOUNT),
    }
    # Busy only `utilization` of the time: the idle hours are paid for all the same.
    effective_tps = inp.tokens_per_s * inp.utilization if inp.tokens_per_s else None
    capacity = (monthly_capacity_tokens(inp.tokens_per_s, inp.utilization, inp.hours_per_month)
                if inp.tokens_per_s else None)
    tiers = []
    for name, usd_h in prices.items():
        be = breakeven_tokens_per_month(usd_h, inp.api_usd_per_1m, inp.hours_per_month) if inp.api_usd_per_1m else None
        tiers.append(Tier(
            name=name,
            usd_per_hour=usd_h,
            usd_per_month=monthly_cost(usd_h, inp.hours_per_month),
            usd_per_1m_tokens=usd_per_1m_tokens(usd_h, effective_tps) if effective_tps else None,
            tokens_per_s_for_target=(tokens_per_s_for(usd_h, inp.target_usd_per_1m) / inp.utilization
                                     if inp.target_usd_per_1m else None),
            breakeven_tokens_per_month=be,
            breakeven_within_capacity=(be <= capacity) if be is not None and capacity is not None else None,
        ))
    return {"inputs": asdict(inp), "monthly_capacity_tokens": capacity, "tiers": [asdict(t) for t in tiers]}


# -- loadtest result files --
def _runs(data: Any) -> list[dict[str, Any]]:
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        return data["runs"]
    if isinstance(data, list):
        return data
    return [data]


def from_result(path: Path, run: str | None = None) -> tuple[float | None, float | None, str]:
    """(fleet $/hour, output tokens/s, label) measured by `usefulwork loadtest`."""
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CostModelError(f"{path}: cannot read: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: not JSON: {exc}") from None
    runs = [r for r in _runs(data) if isinstance(r, dict)]
    if run is not None:
        runs = [r for r in runs if run in (r.get("label"), r.get("name"))]
        if not runs:
            raise CostModelError(f"{path}: no run labelled {run!r}")
    if not runs:
        raise CostModelError(f"{path}: no runs in the file")
    if len(runs) > 1 and run is None:
        labels = ", ".join(str(r.get("label") or r.get("name")) for r in runs)
        raise CostModelError(f"{path}: {len(runs)} runs ({labels}); choose one with --run")
    r = runs[0]
    tps = r.get("output_throughput")
    usd_h = r.get("fleet_usd_per_hour")
    return (float(usd_h) if usd_h else None, float(tps) if tps else None,
            f"{path}" + (f" run {r.get('label')}" if r.get("label") else ""))


# -- CLI --
def configure_parser(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.split("\n\n")[0] + ". " + __doc__.split("\n\n")[1].replace("\n", " ")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    src = p.add_argument_group("fleet price")
    src.add_argument("--usd-per-hour", type=float, help="the whole fleet's on-demand $/hour")
    src.add_argument("--gpu-usd-per-hour", type=float, help="one GPU's on-demand $/hour (with --gpus)")
    src.add_argument("--gpus", type=int, default=1, help="GPUs in the fleet (default 1)")
    src.add_argument("--reserved-usd-per-hour", type=float,
                     help=f"fleet $/hour reserved (default: on-demand minus {RESERVED_DISCOUNT * 100:.0f}%%)")
    src.add_argument("--spot-usd-per-hour", type=float,
                     help=f"fleet $/hour on spot (default: on-demand minus {SPOT_DISCOUNT * 100:.0f}%%)")
    work = p.add_argument_group("throughput and targets")
    work.add_argument("--tokens-per-s", type=float, help="generated tokens per second the fleet sustains")
    work.add_argument("--utilization", type=float, default=1.0,
                      help="fraction of the time the fleet runs at that rate (default 1.0)")
    work.add_argument("--target-usd-per-1m", type=float, help="a target $ per 1M tokens: which tokens/s it needs")
    work.add_argument("--api-usd-per-1m", type=float, help="an API's (blended) $ per 1M tokens, for the break-even")
    work.add_argument("--hours-per-month", type=float, default=HOURS_PER_MONTH)
    p.add_argument("--from-result", type=Path, help="a `usefulwork loadtest` results.json (measured tokens/s, $/hour)")
    p.add_argument("--run", help="which run of a multi-run result file (its label)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _inputs(args: argparse.Namespace) -> Inputs:
    usd_h, tps, source = None, None, "flags"
    if args.from_result is not None:
        usd_h, tps, source = from_result(args.from_result, args.run)
    if args.gpu_usd_per_hour is not None:
        if args.gpus < 1:
            raise CostModelError("--gpus must be >= 1")
        usd_h = args.gpu_usd_per_hour * args.gpus
    if args.usd_per_hour is not None:
        usd_h = args.usd_per_hour
    if args.tokens_per_s is not None:
        tps = args.tokens_per_s
    if usd_h is None:
        raise CostModelError("no $/hour: give --usd-per-hour, --gpu-usd-per-hour, or --from-result")
    if tps is not None and tps <= 0:
        raise CostModelError("tokens/s must be > 0")
    return Inputs(usd_per_hour=usd_h, tokens_per_s=tps, target_usd_per_1m=args.target_usd_per_1m,
                  api_usd_per_1m=args.api_usd_per_1m, utilization=args.utilization,
                  hours_per_month=args.hours_per_month, reserved_usd_per_hour=args.reserved_usd_per_hour,
                  spot_usd_per_hour=args.spot_usd_per_hour, source=source)


def _num(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    inp = result["inputs"]
    console = Console(width=max(Console().width, 110))
    title = f"inference cost model ({inp['source']})"
    t = Table(title=title)
    for col in ("tier", "$/hour", "$/month", "$/1M tok", "tok/s for target", "break-even tok/month", "fits"):
        t.add_column(col, justify="left" if col == "tier" else "right", no_wrap=True)
    for tier in result["tiers"]:
        within = tier["breakeven_within_capacity"]
        t.add_row(tier["name"], _num(tier["usd_per_hour"], ",.4f"), _num(tier["usd_per_month"], ",.2f"),
                  _num(tier["usd_per_1m_tokens"], ",.4f"), _num(tier["tokens_per_s_for_target"], ",.1f"),
                  _num(tier["breakeven_tokens_per_month"], ",.0f"), "-" if within is None else ("yes" if within else "no"))
    console.print(t)
    notes = []
    if inp["tokens_per_s"]:
        notes.append(f"at {inp['tokens_per_s']:,.1f} tokens/s x {inp['utilization']:.0%} utilization; "
                     f"capacity {result['monthly_capacity_tokens']:,.0f} tokens/month")
    if inp["target_usd_per_1m"]:
        notes.append(f"target ${inp['target_usd_per_1m']} per 1M tokens")
    if inp["api_usd_per_1m"]:
        notes.append(f"API at ${inp['api_usd_per_1m']} per 1M tokens; fits: the fleet can produce the "
                     "break-even volume")
    for n in notes:
        console.print(f"  {n}")


def run(args: argparse.Namespace) -> int:
    try:
        result = evaluate(_inputs(args))
    except CostModelError as exc:
        print(f"usefulwork cost: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0
