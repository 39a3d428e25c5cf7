"""Routing config: unknown router or picker names, cascades naming missing pools, duplicate names."""

from __future__ import annotations

import pytest

from usefulwork import config

POOLS = [{"name": "small", "models": ["s-model"], "replicas": ["http://127.0.0.1:1"]},
         {"name": "large", "models": ["l-model"], "replicas": ["http://127.0.0.1:2"]}]


def load(routing: dict) -> config.Config:
    return config.from_mapping({"pools": POOLS, "routing": routing}, environ={})


def vm(**kw) -> dict:
    return {"name": "auto", "small_pool": "small", "large_pool": "large", **kw}


def test_a_valid_cascade_loads():
    cfg = load({"virtual_models": [vm(router="classifier")], "pickers": {"small": {"kind": "prefix"}}})
    assert cfg.routing.virtual_models[0].router == "classifier"
    assert cfg.routing.picker_for("small").kind == "prefix"
    assert cfg.routing.picker_for("large").kind == "least-loaded"


@pytest.mark.parametrize("routing, message", [
    ({"virtual_models": [vm(router="oracle")]}, r"routing\.virtual_models\.0\.router: Input should be 'heuristic', 'classifier' or 'confidence-gated'"),
    ({"virtual_models": [vm(large_pool="huge")]}, r"routing\.virtual_models\.0\.large_pool: no pool named 'huge'"),
    ({"virtual_models": [vm(small_pool="tiny")]}, r"routing\.virtual_models\.0\.small_pool: no pool named 'tiny'"),
    ({"virtual_models": [vm(name="s-model")]}, r"routing\.virtual_models\.0\.name: 's-model' is already a model"),
    ({"virtual_models": [vm(), vm()]}, r"routing\.virtual_models\.1\.name: 'auto' appears twice"),
    ({"virtual_models": [vm(confidence={"min_mean_logprob": 0.5})]}, r"confidence\.min_mean_logprob"),
    ({"virtual_models": [vm(confidence={"hold_tokens": 0})]}, r"confidence\.hold_tokens"),
    ({"virtual_models": [vm(classifier={"threshold": 1.5})]}, r"classifier\.threshold"),
    ({"pickers": {"small": {"kind": "random"}}}, r"routing\.pickers\.small\.kind: Input should be 'least-loaded', 'round-robin'"),
    ({"pickers": {"nope": {"kind": "prefix"}}}, r"routing\.pickers\.nope: no pool named 'nope'"),
    ({"pickers": {"small": {"balance_rel": 0.5}}}, r"routing\.pickers\.small\.balance_rel"),
])
def test_bad_routing_config_names_the_field(routing, message):
    with pytest.raises(config.ConfigError, match=message):
        load(routing)
