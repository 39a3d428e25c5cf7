"""One entry point: `usefulwork serve | sim | loadtest | router | tenants | ledger | replay | cost`.

Each subcommand lives in its own module, imported only when chosen (start-up stays fast and a
missing optional dependency of one command never breaks another). A module provides
``configure_parser(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("usefulwork.gateway.serve", "run the gateway (embedded local vLLM fleet unless --config)"),
    "sim": ("usefulwork.backends.sim.cli", "run a simulated vLLM server (GPU what-if planning)"),
    "loadtest": ("usefulwork.loadtest.cli", "steady/burst load and the cost-per-useful-work matrix"),
    "router": ("usefulwork.routers.cli", "train and evaluate the cascade routers on labeled prompts"),
    "tenants": ("usefulwork.gateway.tenants", "tenant keys: print the hash of a new API key for the config; say whose a key is"),
    "ledger": ("usefulwork.gateway.accounting.report", "cost per useful work from the ledger, per tenant, model, pool, day"),
    "replay": ("usefulwork.loadtest.replay_cli", "re-send a recorded traffic log; compare two setups on it"),
    "cost": ("usefulwork.costmodel", "the inference cost model: $/1M tokens, break-even, pricing tiers"),
}


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="usefulwork", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="COMMAND",
                   help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items()))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        args = _top_parser().parse_args(argv[:1])
        if args.version:
            from usefulwork import __version__

            print(__version__)
            return 0
        _top_parser().print_help()
        return 2
    module_name, help_text = COMMANDS[argv[0]]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(prog=f"usefulwork {argv[0]}", description=help_text)
    module.configure_parser(parser)
    args = parser.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
