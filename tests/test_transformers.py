"""hf_flash as a transformers attention backend, on tiny random-init fp32 models (CPU).

Every model in ``MODELS`` is built from the same seed with ``eager``, ``sdpa``
(where it computes the same math) and ``hf_flash``; logits on valid tokens and
all parameter gradients must agree within fp32 round-off. The ``kernel_calls``
fixture (conftest.py) spies on hf_flash's forward/backward so that a silent
fall-back to eager math cannot pass.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import hf_flash  # noqa: E402  (registers "hf_flash")
from hf_flash import UnsupportedModelError  # noqa: E402
from hf_flash.integration import UnsupportedAttentionError, attention_forward  # noqa: E402

VOCAB, SEQ, LENGTHS, LAYERS = 97, 12, (12, 7), 2  # batch of 2: one full row, one padded row
WINDOW = 4  # sliding windows smaller than SEQ, so they change the result
# fp32 round-off. Measured max |diff| over all models/paddings vs eager and sdpa: 7.6e-6 on logits
# (|logits| up to ~10) and 3.1e-5 on gradients (|grad| up to ~25); a wrong feature gives >1e-2.
LOGITS_TOL = dict(atol=5e-5, rtol=1e-4)
GRAD_TOL = dict(atol=1e-4, rtol=1e-3)
# Larger than the default 0.02 init: scores big enough for softcap to bite and
# greedy argmax far from ties.
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
               bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
ENCODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
               max_position_embeddings=64, initializer_range=0.2, hidden_dropout_prob=0.0,
               attention_probs_dropout_prob=0.0)


@dataclass(frozen=True)
class Spec:
    config: str  # transformers config class
    model: str  # transformers model class (a head with vocab logits)
    kwargs: dict
    causal: bool = False
    sdpa: bool = True  # does sdpa compute the same math (Gemma2's sdpa drops softcap)
    dropout_key: str = "attention_dropout"
    # position_ids-only packing needs the model to pass position_ids down to attention
    packs_by_position_ids: bool = True
    # config overrides that switch the model's special attention feature off: eager logits must change
    ablations: tuple = field(default_factory=tuple)


MODELS = {
    "llama": Spec("LlamaConfig", "LlamaForCausalLM", DECODER, causal=True),
    "qwen2": Spec("Qwen2Config", "Qwen2ForCausalLM",
                  {**DECODER, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
                  causal=True, ablations=({"use_sliding_window": False},)),
    "mistral": Spec("MistralConfig", "MistralForCausalLM", {**DECODER, "sliding_window": WINDOW}, causal=True,
                    ablations=({"sliding_window": None},)),
    "gemma2": Spec("Gemma2Config", "Gemma2ForCausalLM",
                   {**DECODER, "head_dim": 16, "sliding_window": WINDOW, "attn_logit_softcapping": 1.0,
                    "final_logit_softcapping": None, "query_pre_attn_scalar": 64},
                   causal=True, sdpa=False,
                   ablations=({"attn_logit_softcapping": None}, {"sliding_window": 64}, {"query_pre_attn_scalar": 16})),
    "bert": Spec("BertConfig", "BertForMaskedLM", ENCODER, dropout_key="attention_probs_dropout_prob"),
    "roberta": Spec("RobertaConfig", "RobertaForMaskedLM", {**ENCODER, "pad_token_id": 1},
                    dropout_key="attention_probs_dropout_prob"),
    "distilbert": Spec("DistilBertConfig", "DistilBertForMaskedLM",
                       dict(vocab_size=VOCAB, dim=64, hidden_dim=128, n_layers=LAYERS, n_heads=4,
                            max_position_embeddings=64, initializer_range=0.2, dropout=0.0, attention_dropout=0.0),
                       packs_by_position_ids=False),
    "modernbert": Spec("ModernBertConfig", "ModernBertForMaskedLM",
                       dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                            num_attention_heads=4, max_position_embeddings=64, initializer_range=0.2,
                            local_attention=6, global_attn_every_n_layers=LAYERS,  # layer 1 sees +-3 tokens
                            pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
                       packs_by_position_ids=False, ablations=({"local_attention": 128},)),
    # learned attention sinks (s_aux) on alternating windowed and full layers, GQA; sdpa drops the sinks
    "gpt_oss": Spec("GptOssConfig", "GptOssForCausalLM",
                    {**DECODER, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                     "sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]},
                    causal=True, sdpa=False, ablations=({"sliding_window": 64},)),
}
CAUSAL = [name for name, spec in MODELS.items() if spec.causal]


def build(name: str, impl: str, **overrides):
    spec = MODELS[name]
    config = getattr(transformers, spec.config)(**{**spec.kwargs, **overrides})
    torch.manual_seed(0)  # identical weights for every implementation
    return getattr(transformers, spec.model)._from_config(config, attn_implementation=impl).eval()


def others(name: str) -> list[str]:
    return ["eager", "sdpa"] if MODELS[name].sdpa else ["eager"]


def data(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (len(LENGTHS), SEQ), generator=g)
    targets = torch.randint(0, VOCAB, (len(LENGTHS), SEQ), generator=g)
    return ids, targets


def padding_mask(side: str) -> torch.Tensor:
    pos, n = torch.arange(SEQ), torch.tensor(LENGTHS)[:, None]
    return (pos >= SEQ - n if side == "left" else pos < n).long()


def logits_and_grads(model, targets, valid, **inputs):
    """Logits at `valid` positions and the gradients of a token cross-entropy over them."""
    model.zero_grad(set_to_none=True)
    logits = model(**inputs).logits
    loss = torch.nn.functional.cross_entropy(logits[valid], targets[valid], reduction="sum")
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits[valid].detach(), grads


def assert_same(actual, expected, what: str) -> None:
    (la, ga), (le, ge) = actual, expected
    torch.testing.assert_close(la, le, **LOGITS_TOL, msg=lambda m: f"{what} logits: {m}")
    assert ga.keys() == ge.keys() and len(ga) > 0
    for n in ge:
        torch.testing.assert_close(ga[n], ge[n], **GRAD_TOL, msg=lambda m, n=n: f"{what} grad {n}: {m}")


@pytest.mark.parametrize("name", [n for n, s in MODELS.items() if s.ablations])
def test_special_attention_features_matter(name):
    """Windows, softcap and scaling are set so that switching them off changes the logits."""
    ids, _ = data()
    base = build(name, "eager")(input_ids=ids).logits
    for ablation in MODELS[name].ablations:
        changed = build(name, "eager", **ablation)(input_ids=ids).logits
        assert (changed - base).abs().max() > 1e-2, f"{name}: {ablation} does not change the output"


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("name", list(MODELS))
def test_padded_batch_matches(name, side, kernel_calls):
    ids, targets = data()
    mask = padding_mask(side)
    valid = mask.bool()
    ours = logits_and_grads(build(name, "hf_flash"), targets, valid, input_ids=ids, attention_mask=mask)
    assert kernel_calls == {"fwd": LAYERS, "bwd": LAYERS}  # every layer, forward and backward, ran hf_flash
    for impl in others(name):
        ref = logits_and_grads(build(name, impl), targets, valid, input_ids=ids, attention_mask=mask)
        assert_same(ours, ref, f"{name} {side}-padded hf_flash vs {impl}")


@pytest.mark.parametrize("flash_kwargs", [False, True], ids=["position_ids", "cu_seq_lens"])
@pytest.mark.parametrize("name", list(MODELS))
def test_packed_matches_unpacked(name, flash_kwargs, kernel_calls, request):
    if not flash_kwargs and not MODELS[name].packs_by_position_ids:
        request.applymarker(pytest.mark.xfail(
            strict=True, reason=f"transformers' {name} does not pass position_ids to its attention layers, so "
                                "no backend can see the packing boundaries: use return_flash_attn_kwargs=True"))
    ids, targets = data()
    seqs = [ids[row, :n] for row, n in enumerate(LENGTHS)]
    tgts = [targets[row, :n] for row, n in enumerate(LENGTHS)]
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collate([{"input_ids": s.tolist()} for s in seqs])
    del batch["labels"]
    if flash_kwargs:
        assert batch["cu_seq_lens_q"].tolist() == [0, LENGTHS[0], sum(LENGTHS)]
    packed_targets = torch.cat(tgts)[None]
    ours = logits_and_grads(build(name, "hf_flash"), packed_targets, torch.ones_like(packed_targets, dtype=bool),
                            **batch)
    assert kernel_calls == {"fwd": LAYERS, "bwd": LAYERS}
    # the same sequences one by one (explicit 0-based positions, as the collator sends), summed loss
    model = build(name, "eager")
    model.zero_grad(set_to_none=True)
    logits = []
    for s, t in zip(seqs, tgts):
        out = model(input_ids=s[None], position_ids=torch.arange(len(s))[None]).logits[0]
        torch.nn.functional.cross_entropy(out, t, reduction="sum").backward()
        logits.append(out.detach())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same(ours, (torch.cat(logits), grads), f"{name} packed ({request.node.callspec.id}) vs unpacked eager")


@pytest.mark.parametrize("packed", [False, True])
def test_batch_of_one_decided_once_per_forward(packed, kernel_calls, monkeypatch):
    """A batch of one with position_ids: whether it is packed (a host sync in transformers' wrapper) and its
    cu_seqlens are worked out once per forward, not in every layer, and the result is still right."""
    from transformers import modeling_flash_attention_utils as mfau

    calls = {"is_packed": 0, "cu_seqlens": 0}
    for fn, key in (("_is_packed_sequence", "is_packed"), ("prepare_fa_kwargs_from_position_ids", "cu_seqlens")):
        def spy(position_ids, *args, _original=getattr(mfau, fn), _key=key, **kwargs):
            calls[_key] += position_ids is not None
            return _original(position_ids, *args, **kwargs)
        monkeypatch.setattr(mfau, fn, spy)
    ids, targets = data()
    lengths = LENGTHS if packed else (SEQ,)
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    ids, targets = ids.flatten()[None, :position_ids.shape[1]], targets.flatten()[None, :position_ids.shape[1]]
    valid = torch.ones_like(ids, dtype=bool)
    ours = logits_and_grads(build("llama", "hf_flash"), targets, valid, input_ids=ids, position_ids=position_ids)
    assert kernel_calls == {"fwd": LAYERS, "bwd": LAYERS}
    assert calls == {"is_packed": 1, "cu_seqlens": int(packed)}
    ref = logits_and_grads(build("llama", "eager"), targets, valid, input_ids=ids, position_ids=position_ids)
    if packed:  # eager does not see the boundaries: compare with the sequences one by one
        model, logits = build("llama", "eager"), []
        model.zero_grad(set_to_none=True)
        for start, n in zip((0, LENGTHS[0]), LENGTHS):
            out = model(input_ids=ids[:, start:start + n], position_ids=torch.arange(n)[None]).logits[0]
            torch.nn.functional.cross_entropy(out, targets[0, start:start + n], reduction="sum").backward()
            logits.append(out.detach())
        ref = torch.cat(logits), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert_same(ours, ref, f"llama batch of one ({'packed' if packed else 'one sequence'}) vs eager")
    position_ids[0, -1] += 0  # an in-place edit: the next forward decides again
    build("llama", "hf_flash")(input_ids=ids, position_ids=position_ids)
    assert calls["is_packed"] == 2


def test_batch_of_several_never_checked_for_packing(kernel_calls, monkeypatch):
    """A batch of several rows with position_ids (the model makes them when the caller gives none) is never checked
    for packing: transformers 5.17's check launches its tensor ops in every layer before looking at the batch
    size. The result still matches eager."""
    from transformers import modeling_flash_attention_utils as mfau

    checked = []
    original = mfau._is_packed_sequence
    monkeypatch.setattr(mfau, "_is_packed_sequence",
                        lambda position_ids, *a, **kw: checked.append(position_ids) or original(position_ids, *a, **kw))
    ids, targets = data()
    valid = torch.ones_like(ids, dtype=bool)
    position_ids = torch.arange(ids.shape[1])[None].expand_as(ids)
    ours = logits_and_grads(build("llama", "hf_flash"), targets, valid, input_ids=ids, position_ids=position_ids)
    assert kernel_calls == {"fwd": LAYERS, "bwd": LAYERS} and ids.shape[0] > 1
    assert all(p is None for p in checked), "position_ids reached the wrapper's packing check"
    ref = logits_and_grads(build("llama", "eager"), targets, valid, input_ids=ids, position_ids=position_ids)
    assert_same(ours, ref, "llama batch of several with position_ids vs eager")


def test_padded_batch_unpadded_once_per_forward(kernel_calls, monkeypatch):
    """A padded batch: the wrapper's unpadding data (two host syncs) is worked out once per forward, not in every
    layer, the result still matches eager, an in-place edit of the mask recomputes, and other backends' calls
    are left alone."""
    calls = []
    original_nonzero = torch.nonzero

    def spy(*args, **kwargs):
        calls.append(1)
        return original_nonzero(*args, **kwargs)

    monkeypatch.setattr(torch, "nonzero", spy)
    ids, targets = data()
    mask = padding_mask("left")
    valid = mask.bool()
    ours = logits_and_grads(build("llama", "hf_flash"), targets, valid, input_ids=ids, attention_mask=mask)
    assert kernel_calls == {"fwd": LAYERS, "bwd": LAYERS} and len(calls) == 1
    assert_same(ours, logits_and_grads(build("llama", "eager"), targets, valid, input_ids=ids, attention_mask=mask),
                "llama padded batch vs eager")
    mask[0, -1] = 1  # an in-place edit (a no-op here): the next forward works it out again
    build("llama", "hf_flash")(input_ids=ids, attention_mask=mask)
    assert len(calls) == 2
    from transformers import modeling_flash_attention_utils as mfau

    mfau._get_unpad_data(mask)  # outside an hf_flash call (another flash backend's): never cached
    mfau._get_unpad_data(mask)
    assert len(calls) == 4


@pytest.mark.parametrize("name", list(MODELS))
def test_attention_dropout_trains(name, kernel_calls):
    """Dropout inside the kernel: finite gradients, a different output, reproducible from the seed."""
    ids, targets = data()
    mask = padding_mask("right")
    model = build(name, "hf_flash", **{MODELS[name].dropout_key: 0.3})
    clean = model(input_ids=ids, attention_mask=mask).logits
    model.train()
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(logits_and_grads(model, targets, mask.bool(), input_ids=ids, attention_mask=mask))
    (logits, grads), (logits2, grads2) = runs
    assert kernel_calls["bwd"] > 0
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert (logits - clean[mask.bool()]).abs().max() > 1e-3, "attention dropout had no effect"
    torch.testing.assert_close(logits2, logits, atol=0, rtol=0)
    for n in grads:
        torch.testing.assert_close(grads2[n], grads[n], atol=0, rtol=0)


def _save(tmp_path):
    build("llama", "eager").save_pretrained(tmp_path)
    return tmp_path


LOADERS = {
    "from_config": lambda tmp: transformers.AutoModelForCausalLM.from_config(
        build("llama", "eager").config, attn_implementation="hf_flash"),
    "from_pretrained": lambda tmp: transformers.AutoModelForCausalLM.from_pretrained(
        _save(tmp), attn_implementation="hf_flash"),
    "set_attn_implementation": lambda tmp: _set(build("llama", "eager")),
}


def _set(model):
    model.set_attn_implementation("hf_flash")
    return model


@pytest.mark.parametrize("loader", list(LOADERS))
def test_loading_paths_select_hf_flash(loader, tmp_path, kernel_calls):
    ids, _ = data()
    mask = padding_mask("left")
    torch.manual_seed(0)
    model = LOADERS[loader](tmp_path).eval()
    assert model.config._attn_implementation == "hf_flash"
    if loader == "from_config":  # fresh random weights: copy the reference ones
        model.load_state_dict(build("llama", "eager").state_dict())
    with torch.no_grad():
        ours = model(input_ids=ids, attention_mask=mask).logits
        ref = build("llama", "eager")(input_ids=ids, attention_mask=mask).logits
    assert kernel_calls["fwd"] == LAYERS
    torch.testing.assert_close(ours[mask.bool()], ref[mask.bool()], **LOGITS_TOL)


def test_eager_does_not_call_hf_flash(kernel_calls):
    """Control for the spy: it counts only hf_flash."""
    with torch.no_grad():
        build("llama", "eager")(input_ids=data()[0])
    assert kernel_calls == {"fwd": 0, "bwd": 0}


def test_output_attentions_fails_clearly():
    model = build("llama", "hf_flash")
    with pytest.raises(UnsupportedAttentionError, match="output_attentions=True"):
        model(input_ids=data()[0], output_attentions=True)


def test_attention_function_refuses_other_score_terms():
    q = torch.randn(1, 2, 4, 8)
    module = torch.nn.Module()
    for term in ("sinks", "position_bias"):
        with pytest.raises(UnsupportedAttentionError, match=term):
            attention_forward(module, q, q, q, None, **{term: torch.zeros(2)})


@pytest.mark.parametrize("model_type", ["bart", "m2m_100"])
def test_cross_attention_with_differently_padded_encoder_and_decoder(model_type):
    """Decoder rows attend to every unpadded encoder key, whatever either side's padding (as eager)."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1)
    enc, enc_mask = torch.randint(3, VOCAB, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    enc_mask[1, 6:] = 0
    dec, dec_mask = torch.randint(3, VOCAB, (2, 7)), torch.ones(2, 7, dtype=torch.long)
    dec_mask[0, 5:] = 0
    logits = {}
    for impl in ("eager", "hf_flash"):
        torch.manual_seed(0)
        model = transformers.AutoModelForSeq2SeqLM.from_config(config, attn_implementation=impl).eval()
        logits[impl] = model(input_ids=enc, attention_mask=enc_mask, decoder_input_ids=dec,
                             decoder_attention_mask=dec_mask).logits
    valid = dec_mask.bool()
    torch.testing.assert_close(logits["hf_flash"][valid], logits["eager"][valid], atol=5e-5, rtol=1e-4)


def test_readme_states_the_range_that_the_package_pins():
    """The README's "Supports transformers A to B" and pyproject's ``transformers>=A,<B+1`` name one range,
    and hf_flash's own minimum is its lower end."""
    import re
    from pathlib import Path

    from hf_flash.integration import MIN_TRANSFORMERS

    root = Path(__file__).resolve().parents[1]
    low, high = re.search(r"Supports transformers (\d+\.\d+) to (\d+\.\d+)", (root / "README.md").read_text()).groups()
    pin = re.search(r'"transformers>=(\d+\.\d+),<(\d+)\.(\d+)"', (root / "pyproject.toml").read_text())
    assert pin, "pyproject.toml pins transformers as >=A,<B"
    assert pin.group(1) == low == ".".join(map(str, MIN_TRANSFORMERS))
    assert f"{pin.group(2)}.{int(pin.group(3)) - 1}" == high
