"""The protocol models behind the Hopper backward (tools/model_cluster_exchange.py: the cluster backward's
partial-score exchange; tools/model_dq_reducers.py: the dQ slot's hand-off to one or two reducers, the
deterministic order and the default mode's claims): the protocol the kernel runs passes every random interleaving
tried, and each model catches each rule's absence, so its passing says something."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest



def _load(name):
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


model = _load("model_cluster_exchange")
reducers = _load("model_dq_reducers")


@pytest.mark.parametrize("shared", [True, False], ids=["d512", "d256"])
def test_exchange_protocol_holds(shared):
    for iters in (0, 1, 2, 5):
        for seed in range(100):
            model.run(iters, seed, shared)


@pytest.mark.parametrize("shared", [True, False], ids=["d512", "d256"])
@pytest.mark.parametrize("mutation", model.MUTATIONS)
def test_exchange_model_catches_a_dropped_rule(mutation, shared):
    expected = {"no_empty_wait": "overwritten", "no_exit_wait": "exited CTA", "arm_after_free": "before the arming"}
    for seed in range(200):
        try:
            model.run(2, seed, shared, mutation)
        except AssertionError as e:
            assert expected[mutation] in str(e)
            return
    pytest.fail(f"{mutation}: no interleaving of 200 broke the protocol")


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "default"])
def test_dq_reducers_protocol_holds(deterministic):
    # (key blocks, query blocks, resident CTAs): one CTA at a time, some, all
    for shape in ((1, 1, 1), (2, 3, 1), (3, 5, 2), (4, 6, 4), (5, 7, 3)):
        for seed in range(150):
            reducers.run(*shape, deterministic, seed)
    # several pairs in sections, block index slowest (deterministic full attention: launch.cuh), and causal
    for pairs, group, causal in ((3, 2, False), (4, 4, False), (5, 2, True), (3, 1, False)):
        for seed in range(60):
            reducers.run(4, 4, 3, deterministic, seed, pairs=pairs, group=group, causal=causal)


@pytest.mark.parametrize("mutation", reducers.MUTATIONS)
def test_dq_reducers_model_catches_a_dropped_rule(mutation):
    expected = {"one_barrier_pair": "read", "no_empty_wait": "overwritten", "release_before_complete": "landed",
                "blocks_reversed": "deadlock", "stored_before_complete": "before the store"}
    deterministic = mutation not in reducers.CLAIM_MUTATIONS
    for seed in range(200):
        try:
            reducers.run(4, 6, 3, deterministic, seed, mutation, pairs=3, group=2, causal=mutation != "blocks_reversed")
        except AssertionError as e:
            assert expected[mutation] in str(e)
            return
    pytest.fail(f"{mutation}: no interleaving of 200 broke the protocol")

