"""The generation benchmark's interleaved measurement, on CPU with a tiny model (the GPU runs it for real):
backends take turns, the first of each round rotates, and a backend that cannot run gets an error row
without stopping the others."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_flash.bench import generate  # noqa: E402


@pytest.fixture
def tiny_case(monkeypatch):
    """A one-layer model and 2 x 8 prompts on the CPU; the CUDA timing and memory calls become no-ops.
    Returns the backends of the timed (4-token) generate calls, in call order."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    timed_calls = []

    def build_model(backend, layers, max_positions):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=backend)
        real = model.generate

        def spy(*args, max_new_tokens, **kwargs):
            if max_new_tokens == 4:
                timed_calls.append(backend)
            return real(*args, max_new_tokens=max_new_tokens, **kwargs)

        model.generate = spy
        return model

    def prompts(batch, length):
        ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        mask[1, :2] = 0  # left padding
        return ids, mask

    monkeypatch.setattr(generate, "build_model", build_model)
    monkeypatch.setattr(generate, "prompts", prompts)
    monkeypatch.setitem(generate.SHAPES, "tiny", (2, 8))
    for name, value in {"synchronize": None, "memory_allocated": 0, "reset_peak_memory_stats": None,
                        "max_memory_allocated": 0, "empty_cache": None}.items():
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    return timed_calls


def test_interleaved_generate_takes_turns(tiny_case):
    backends = ["hf_flash", "sdpa", "no_such_backend", "eager"]
    rows = generate.measure_interleaved(backends, "tiny", layers=1, new_tokens=4, steps=3)
    assert [r.backend for r in rows] == backends
    assert "no_such_backend" in rows[2].error
    assert all(r.tokens_per_s > 0 and not r.error for r in rows if r.backend != "no_such_backend")
    runnable = ["hf_flash", "sdpa", "eager"]
    warm_up, rounds = tiny_case[:3], tiny_case[3:]  # one warm-up call each, then 3 rounds
    assert warm_up == runnable
    assert rounds == runnable + runnable[1:] + runnable[:1] + runnable[2:] + runnable[:2]


def test_interleaved_train_takes_turns(monkeypatch):
    """The e2e training measurement: every backend's model resident, warm-up steps first, then the timed steps
    take turns; a backend that cannot be built gets an error row."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_flash.bench import e2e

    steps = []

    def build_model(backend, layers, max_positions):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=backend)
        model.register_forward_hook(lambda *_: steps.append(backend))
        return model

    monkeypatch.setattr(e2e, "build_model", build_model)
    monkeypatch.setitem(e2e.TRAIN_SHAPES, "tiny", (2, 8))
    monkeypatch.setattr(e2e, "train_batch", lambda shape: {"input_ids": torch.randint(0, 64, (2, 8)),
                                                           "labels": torch.randint(0, 64, (2, 8))})
    for name, value in {"synchronize": None, "memory_allocated": 0, "reset_peak_memory_stats": None,
                        "max_memory_allocated": 0, "empty_cache": None}.items():
        monkeypatch.setattr(torch.cuda, name, lambda value=value: value)
    backends = ["hf_flash", "no_such_backend", "sdpa"]
    rows = e2e.measure_train(backends, "tiny", layers=1, steps=2)
    assert [r.backend for r in rows] == backends
    assert "no_such_backend" in rows[1].error
    assert all(r.tokens_per_s > 0 and not r.error for r in (rows[0], rows[2]))
    warm = e2e.WARMUP_STEPS
    assert steps == ["hf_flash"] * warm + ["sdpa"] * warm + ["hf_flash", "sdpa", "sdpa", "hf_flash"]
