"""Meta-tests of hf_flash.patches (Liger's pattern): the table, instance patching, PEFT, state dicts, refusals."""

from __future__ import annotations

import copy
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import hf_flash  # noqa: E402
from hf_flash import patches  # noqa: E402
from hf_flash.coverage import _inputs, _leaf_attention_modules, _valid, build, tiny_config  # noqa: E402
from hf_flash.patches import MODEL_TYPE_TO_PATCH, PATCH_MODULES, UnsupportedModelError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("model_type", sorted(PATCH_MODULES))
def test_table_entry_importable_with_model_argument(model_type):
    fn = MODEL_TYPE_TO_PATCH[model_type]
    assert fn.__name__ == f"apply_hf_flash_to_{PATCH_MODULES[model_type]}"
    params = inspect.signature(fn).parameters
    assert "model" in params and params["model"].default is None
    module = inspect.getmodule(fn)
    assert module.__name__ == f"hf_flash.patches.{PATCH_MODULES[model_type]}"
    for name in getattr(module, "MODULES", (getattr(module, "MODULE", None),)):
        __import__(name)  # the transformers modules it patches exist in this version


def test_every_patch_module_is_in_the_table():
    files = {p.stem for p in (ROOT / "patches").glob("*.py") if not p.stem.startswith("_")}
    assert files == set(PATCH_MODULES.values())


def test_packaging_lists_every_subpackage():
    """pyproject lists packages explicitly (patches/ and csrc/ are mapped to hf_flash.patches and hf_flash.csrc)."""
    text = (ROOT / "pyproject.toml").read_text()
    listed = set(re.search(r"^packages = \[(.*)\]", text, re.M).group(1).replace('"', "").replace(" ", "").split(","))
    found = {"hf_flash"} | {f"hf_flash.{p.parent.name}" for p in (ROOT / "hf_flash").glob("*/__init__.py")}
    assert found | {"hf_flash.patches", "hf_flash.csrc"} == listed
    installed = Path(hf_flash.patches.__file__)  # this checkout's patches/ (through a hf_flash/patches link too)
    assert installed.resolve() == (ROOT / "patches" / "__init__.py").resolve() or "site-packages" in str(installed)


@pytest.mark.parametrize("model_type", sorted(set(PATCH_MODULES) - {"pop2piano"}))  # audio: tests/test_t5.py
def test_patch_keeps_state_dict_and_matches_eager(model_type, kernel_calls):
    config = tiny_config(model_type)
    eager = build(model_type, config, "eager").eval()
    keys = list(eager.state_dict())
    inputs, valid = _inputs(eager, config)
    expected = _valid(eager(**inputs).logits, valid, inputs)
    assert kernel_calls["fwd"] == 0
    assert hf_flash.patch(eager) is eager
    assert list(eager.state_dict()) == keys
    calls = []
    hooks = [m.register_forward_hook(lambda *a: calls.append(1)) for m in _leaf_attention_modules(eager)]
    actual = _valid(eager(**inputs).logits, valid, inputs)
    for h in hooks:
        h.remove()
    assert kernel_calls["fwd"] == len(calls) > 0  # every attention call ran on the kernel
    # a patch binds only where the code it replaces exists; elsewhere the model ran through the interface
    assert any(patches._common.is_patched(m, n) for m in eager.modules() for n in ("forward", "_attn", "compute_bias")) \
        == (patches.patch_applies(model_type) and model_type != "t5gemma")  # t5gemma widens a window, binds nothing
    torch.testing.assert_close(actual, expected, atol=5e-5, rtol=1e-4)
    loaded = build(model_type, config, "hf_flash").eval()
    assert list(loaded.state_dict()) == keys
    loaded.load_state_dict(eager.state_dict())  # loaded with hf_flash (5.23+: gpt_neo/gptj/falcon's flash classes)
    torch.testing.assert_close(_valid(loaded(**inputs).logits, valid, inputs), expected, atol=5e-5, rtol=1e-4)
    # switching back to eager falls back to the class's own code
    eager.set_attn_implementation("eager") if model_type not in ("gpt_neo", "gptj", "falcon") else None


@pytest.mark.parametrize("rotary_value", [False, True])
def test_roformer_decoder_with_cross_attention_matches_eager(rotary_value, kernel_calls):
    """RoFormer as a decoder over a padded encoder batch: rotary self-attention (values too) and cross-attention."""
    config = tiny_config("roformer")
    config.is_decoder = config.add_cross_attention = True
    config.rotary_value = rotary_value
    ids = torch.randint(3, 100, (2, 9))
    mask = torch.tensor([[1] * 9, [1] * 6 + [0] * 3])
    states = torch.randn(2, 7, config.hidden_size)
    states_mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    results = []
    for impl in ("eager", "hf_flash"):
        torch.manual_seed(0)
        model = transformers.RoFormerForCausalLM._from_config(copy.deepcopy(config), attn_implementation=impl)
        out = model(input_ids=ids, attention_mask=mask, encoder_hidden_states=states,
                    encoder_attention_mask=states_mask, use_cache=False).logits[mask.bool()]
        out.pow(2).mean().backward()
        results.append((out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    assert kernel_calls["fwd"] == 2 * config.num_hidden_layers  # self- and cross-attention in each layer
    (out_e, grads_e), (out_f, grads_f) = results
    torch.testing.assert_close(out_f, out_e, atol=5e-5, rtol=1e-4)
    assert grads_e.keys() == grads_f.keys()
    for name, grad in grads_e.items():
        torch.testing.assert_close(grads_f[name], grad, atol=2e-4, rtol=2e-3, msg=name)


def test_patch_applies_only_where_its_code_exists():
    """Checked by what the transformers module defines, never by its version (codegen and gptj moved onto the
    attention interface in 5.24: no ``_attn``, no ``GPTJ_ATTENTION_CLASSES``)."""
    from transformers.models.codegen import modeling_codegen
    from transformers.models.gptj import modeling_gptj

    assert patches.patch_applies("codegen") == hasattr(modeling_codegen.CodeGenAttention, "_attn")
    assert patches.patch_applies("gptj") == (hasattr(modeling_gptj, "GPTJ_ATTENTION_CLASSES")
                                             and hasattr(modeling_gptj.GPTJAttention, "_attn"))
    assert not patches.patch_applies("llama")
    assert all(isinstance(patches.patch_applies(t), bool) for t in PATCH_MODULES)


def test_patch_steps_aside_when_its_code_is_gone(monkeypatch):
    """A patch whose code is gone binds nothing; the model is then checked like any other type."""
    module = inspect.getmodule(MODEL_TYPE_TO_PATCH["bloom"])
    model = build("bloom", tiny_config("bloom"), "eager")
    monkeypatch.setattr(module, "applies", lambda: False)
    assert not patches.patch_applies("bloom")
    assert MODEL_TYPE_TO_PATCH["bloom"](model=model) == 0
    assert not any(patches._common.is_patched(m) for m in model.modules())
    # bloom (5.17-5.24) still computes attention itself: without its patch it refuses, never crashes
    with pytest.raises(UnsupportedModelError, match="'bloom'.*computes attention itself"):
        hf_flash.patch(model)


def _module_with_attention_call(tmp_path, monkeypatch, name: str, call: str):
    """A modeling module ``name`` whose attention calls the looked-up attention function as ``call``."""
    (tmp_path / f"{name}.py").write_text(
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n\n\n"
        "class FakeAttention:\n"
        "    def forward(self, q, k, v, mask, **kwargs):\n"
        "        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface('eager', None)\n"
        f"        return {call}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    module = importlib.import_module(name)
    return type("FakeForCausalLM", (), {"__module__": module.__name__})


@pytest.mark.parametrize("term", ["sinks", "position_bias", "some_new_score_term"])
def test_score_terms_detected_from_the_models_code(term, tmp_path, monkeypatch):
    """A keyword the attention call passes beyond what hf_flash carries refuses at load, for any model type;
    carrying it is adding its name to ``CARRIED_ATTENTION_KWARGS``."""
    from hf_flash import integration

    patches.attention_call_kwargs.cache_clear()
    cls = _module_with_attention_call(tmp_path, monkeypatch, f"fake_modeling_{term}",
                                      f"attention_interface(self, q, k, v, mask, scaling=0.5, {term}=None, **kwargs)")
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4)
    config.model_type = "brand_new_type"
    assert patches.attention_call_kwargs(cls.__module__) == {"scaling", term}
    with pytest.raises(UnsupportedModelError, match=f"'brand_new_type'.*{term}="):
        patches.check_supported(cls, config)
    monkeypatch.setattr(integration, "CARRIED_ATTENTION_KWARGS", integration.CARRIED_ATTENTION_KWARGS | {term})
    patches.check_supported(cls, config)
    patches.attention_call_kwargs.cache_clear()


@pytest.mark.parametrize("config_cls, sizes, detail", [
    ("LlamaConfig", dict(head_dim=576), r"config.head_dim = 576"),
    ("GPT2Config", dict(n_embd=2048, n_head=2), r"hidden_size // config.num_attention_heads = 1024"),  # no head_dim
])
def test_head_dim_above_the_maximum_refuses_at_load(config_cls, sizes, detail):
    from hf_flash.interface import MAX_HEAD_DIM

    config = getattr(transformers, config_cls)(**sizes)
    config.model_type = "brand_new_type"
    with pytest.raises(UnsupportedModelError, match=f"'brand_new_type'.*{detail}.*{MAX_HEAD_DIM}"):
        patches.check_supported(transformers.LlamaForCausalLM, config)
    patches.check_supported(transformers.LlamaForCausalLM, transformers.LlamaConfig(head_dim=MAX_HEAD_DIM))


def test_refusal_table_holds_only_what_detection_cannot_see():
    """An entry of ``REFUSED`` whose need the model's code or config shows (a score term, a head dim) belongs to
    detection, not to the table."""
    from transformers import CONFIG_MAPPING

    from hf_flash.integration import CARRIED_ATTENTION_KWARGS
    from hf_flash.interface import MAX_HEAD_DIM

    for model_type in patches.REFUSED:
        if model_type not in CONFIG_MAPPING:
            continue
        config = tiny_config(model_type)
        module = CONFIG_MAPPING[model_type].__module__.replace(".configuration_", ".modeling_")
        __import__(module)
        assert not patches.attention_call_kwargs(module) - CARRIED_ATTENTION_KWARGS, model_type
        assert all(d <= MAX_HEAD_DIM for d in patches._head_dims(config).values()), model_type


def test_patch_on_peft_wrapped_model(kernel_calls):
    peft = pytest.importorskip("peft")
    config = tiny_config("gptj")
    model = build("gptj", config, "eager").eval()
    ids = torch.randint(3, 100, (1, 7))
    expected = model(input_ids=ids).logits
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    hf_flash.patch(wrapped)
    actual = wrapped(input_ids=ids).logits
    assert kernel_calls["fwd"] == config.n_layer
    torch.testing.assert_close(actual, expected, atol=5e-5, rtol=1e-4)  # LoRA B starts at zero
    assert all(k in wrapped.state_dict() for k in wrapped.state_dict())


def test_unpatched_bypassing_model_refuses_at_load():
    config = tiny_config("xlnet")
    with pytest.raises(UnsupportedModelError, match=r"'xlnet'.*gpt_neo"):
        build("xlnet", config, "hf_flash")
    model = build("xlnet", config, "eager")
    with pytest.raises(UnsupportedModelError, match="xlnet"):
        hf_flash.patch(model)
    assert model.config._attn_implementation == "eager"  # refused before changing anything


def test_attention_free_model_refuses_at_load():
    with pytest.raises(UnsupportedModelError, match="no attention layers"):
        build("mamba", tiny_config("mamba"), "hf_flash")


def test_other_models_of_a_patched_class_are_untouched(kernel_calls):
    config = tiny_config("bloom")
    flash = build("bloom", copy.deepcopy(config), "hf_flash")  # from_config keeps the config object
    eager = build("bloom", copy.deepcopy(config), "eager")
    ids = torch.randint(3, 100, (1, 5))
    eager(input_ids=ids)
    assert kernel_calls["fwd"] == 0
    flash(input_ids=ids)
    assert kernel_calls["fwd"] == config.n_layer
    assert patches._common.is_patched(flash.transformer.h[0].self_attention)
    assert not patches._common.is_patched(eager.transformer.h[0].self_attention)


def test_model_pinning_flash_kernels_keeps_hf_flash(kernel_calls):
    """A class with ``_compatible_flash_implementations`` (flint, gpt-oss, ...) would have "hf_flash" rewritten to
    its first hub kernel; loading with hf_flash adds ours to the list, so it runs on hf_flash (or refuses)."""

    class PinnedLlama(transformers.LlamaForCausalLM):
        _compatible_flash_implementations = ["kernels-community/vllm-flash-attn3"]

    config = tiny_config("llama")
    torch.manual_seed(0)
    model = PinnedLlama._from_config(config, attn_implementation="hf_flash").eval()
    assert model.config._attn_implementation == "hf_flash"
    assert PinnedLlama._compatible_flash_implementations[-1] == "hf_flash"
    model(input_ids=torch.randint(3, 100, (1, 5)))
    assert kernel_calls["fwd"] == config.num_hidden_layers


def test_learned_sinks_are_carried():
    """gpt-oss's learned sinks (s_aux) are a score term hf_flash carries: its attention call passes the check."""
    from hf_flash import integration

    assert "s_aux" in integration.CARRIED_ATTENTION_KWARGS


def test_sink_and_bias_models_refuse_at_load():
    """Per-token sinks and position biases are score terms hf_flash does not carry (learned per-head sinks, s_aux,
    it does: flint, new in 5.23, matches)."""
    for model_type in ("inkling_text", "inkling2_text", "inkling2_loop_text"):
        try:
            config = tiny_config(model_type)
        except KeyError:  # not in this transformers version
            continue
        with pytest.raises(UnsupportedModelError, match=f"'{model_type}'.*(sinks|position bias)"):
            build(model_type, config, "hf_flash")


def test_extended_padding_mask_becomes_2d_or_refuses():
    """BERT's extended mask (layoutlm, markuplm) converts to the 2-D padding mask; anything else raises."""
    from hf_flash.integration import UnsupportedAttentionError
    from hf_flash.patches._common import padding_mask_from_extended

    valid = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
    for big_negative in (torch.finfo(torch.float32).min, -10000.0):
        additive = (~valid)[:, None, None, :].float() * big_negative
        assert torch.equal(padding_mask_from_extended(additive), valid)
    assert torch.equal(padding_mask_from_extended(valid[:, None, None, :]), valid)
    assert padding_mask_from_extended(torch.zeros(2, 1, 1, 5)) is None
    with pytest.raises(UnsupportedAttentionError, match="score bias"):
        padding_mask_from_extended(torch.randn(2, 1, 1, 5))
    with pytest.raises(UnsupportedAttentionError, match="extended padding mask"):
        padding_mask_from_extended(torch.zeros(2, 1, 5, 5))


def test_checkout_without_install_finds_patches(tmp_path):
    """A checkout run from its root without installing (PYTHONPATH=.) has no hf_flash/patches (pyproject.toml maps
    patches/ there at install): the package imports it from beside itself (hf_flash/__init__.py)."""
    root = Path(__file__).resolve().parents[1]
    shutil.copytree(root / "hf_flash", tmp_path / "hf_flash", ignore=shutil.ignore_patterns("patches", "__pycache__"))
    for folder in ("patches", "csrc"):
        shutil.copytree(root / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    # An editable install's finder would map hf_flash.patches to this checkout's patches/: drop it, as a machine
    # with the checkout alone has none.
    code = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, '__name__', '') != '_EditableFinder']; "
            "import importlib, hf_flash; print(hf_flash.patches.__file__); "
            "print(importlib.import_module('hf_flash.patches.t5').__file__); print(hf_flash.patch.__module__)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines[:2] == [str(tmp_path / "patches" / "__init__.py"), str(tmp_path / "patches" / "t5.py")], out.stdout
    assert lines[2] == "hf_flash.patches"
