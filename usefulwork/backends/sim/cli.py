"""`usefulwork sim`: run a simulated vLLM server (OpenAI API + /metrics) for a GPU, model and profile.

    usefulwork sim --gpu A100-80G --model Llama-3.1-8B --precision bf16 --tp 1 \\
        --profile optimized-batched --served-model-name llama --port 18000 --time-scale 20 --seed 0 \\
        [--max-num-seqs 64 --max-num-batched-tokens 4096 --no-enable-chunked-prefill ...]

Any vLLM engine flag the simulator models can be given with vLLM's own name; it overrides the
profile. ``--config sim.yaml`` reads the same settings from a YAML mapping (keys as the long
options with '_' or '-': gpu, model, precision, tp, profile, served_model_name, time_scale, seed,
eos_median_tokens, max_num_seqs, enable_chunked_prefill, ...); options on the command line win.
``--print-spec`` prints the resolved server (KV blocks, limits, $/hour) and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from usefulwork.backends.sim.catalog import ENGINE_FLAGS, SpecError, build_spec, names

# Built-in defaults, applied after --config (so a config file can set what the command line omits).
DEFAULTS: dict[str, Any] = {"precision": "bf16", "tp": 1, "profile": "optimized-batched", "port": 18000,
                            "time_scale": 1.0, "seed": 0, "eos_median_tokens": 256, "host": "127.0.0.1"}
SETTINGS = ("gpu", "model", "precision", "tp", "profile", "served_model_name", "host", "port", "time_scale", "seed",
            "eos_median_tokens", "tokenizer", "kv_events_config")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", default=None, help=f"hardware from the catalog: {', '.join(names('gpus'))} "
                        "(default: the profile's, else A100-80G)")
    parser.add_argument("--model", default=None, help=f"model from the catalog: {', '.join(names('models'))} "
                        "(default: the profile's, else Llama-3.1-8B)")
    parser.add_argument("--precision", default=None, help=f"weights: {', '.join(names('precisions'))} (default bf16)")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=None,
                        help="tensor-parallel degree (default 1)")
    parser.add_argument("--profile", default=None,
                        help=f"serving profile: {', '.join(names('profiles'))} (default optimized-batched)")
    parser.add_argument("--served-model-name", default=None, help="model id clients send (default: the model name)")
    parser.add_argument("--host", default=None, help="default 127.0.0.1")
    parser.add_argument("--port", type=int, default=None, help="default 18000")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="simulated seconds per wall second (20: runs 20x faster than the real GPU; default 1)")
    parser.add_argument("--seed", type=int, default=None, help="seed for output lengths, tokens and logprobs (default 0)")
    parser.add_argument("--eos-median-tokens", type=int, default=None,
                        help="median natural output length when a request does not set ignore_eos (default 256)")
    parser.add_argument("--config", default=None, help="YAML file with any of these settings (command line wins)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer folder (default: the converted SmolLM2 folder); 'approx' for ~4 bytes/token")
    parser.add_argument("--kv-events-config", default=None,
                        help="vLLM's KV-cache event publisher config (JSON), e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'")
    parser.add_argument("--print-spec", action="store_true", help="print the resolved spec as JSON and exit")
    group = parser.add_argument_group("vLLM engine flags (override the profile)")
    for flag, typ in ENGINE_FLAGS.items():
        opt = "--" + flag.replace("_", "-")
        if typ is bool:
            group.add_argument(opt, dest=flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            group.add_argument(opt, dest=flag, type=typ, default=None)


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k, None) is not None}


def apply_config(args: argparse.Namespace) -> None:
    """Fill options not given on the command line from --config, then from DEFAULTS."""
    if args.config:
        import yaml

        with open(args.config) as fh:
            tree = yaml.safe_load(fh) or {}
        if not isinstance(tree, dict):
            raise SpecError(f"{args.config}: the top level must be a mapping")
        for key, value in tree.items():
            k = str(key).replace("-", "_")
            if k not in SETTINGS and k not in ENGINE_FLAGS:
                raise SpecError(f"{args.config}: unknown setting {key!r}")
            if getattr(args, k, None) is None:
                setattr(args, k, value)
    for k, v in DEFAULTS.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)


def run(args: argparse.Namespace) -> int:
    try:
        apply_config(args)
        spec = build_spec(args.gpu, args.model, args.precision, args.tp, args.profile, overrides_from_args(args),
                          eos_median_tokens=args.eos_median_tokens)
    except SpecError as exc:
        print(f"usefulwork sim: {exc}", file=sys.stderr)
        return 2
    if args.print_spec:
        print(json.dumps(spec.describe(), indent=2))
        return 0

    import uvicorn

    from usefulwork.backends.sim.server import build_server

    served = args.served_model_name or spec.model.name
    try:
        app = build_server(spec, served, time_scale=args.time_scale, seed=args.seed, tokenizer=args.tokenizer,
                           kv_events_config=args.kv_events_config)
    except ValueError as exc:
        print(f"usefulwork sim: {exc}", file=sys.stderr)
        return 2
    d = spec.describe()
    print(
        f"usefulwork sim: {d['gpu']} x{d['tp']} {d['model']} {d['precision']} profile={d['profile']} "
        f"kv_blocks={d['num_gpu_blocks']} max_model_len={d['max_model_len']} time_scale={args.time_scale} "
        f"serving '{served}' on http://{args.host}:{args.port}",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0
