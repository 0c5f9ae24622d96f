"""The protocol model behind the cluster backward's partial-score exchange (tools/model_cluster_exchange.py): the
protocol the kernel runs passes every random interleaving tried, and the model catches each rule's absence, so
its passing says something."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parent.parent / "tools" / "model_cluster_exchange.py"
_spec = importlib.util.spec_from_file_location("model_cluster_exchange", _PATH)
model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(model)


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
