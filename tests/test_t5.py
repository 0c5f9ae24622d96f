"""The T5 family on hf_flash (patches/t5.py): the relative position bias as a per-distance table, greedy generation
equal to eager on a random-init model of t5-small's real config, LongT5's local encoder, Pop2Piano, refusals.
Logits and gradients of every family type against eager are the coverage sweep's (tests/test_coverage.py); the
kernels' rel_bias against a float32 reference is tests/test_kernels_rel_bias.py. CPU tests run the reference path."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import hf_flash  # noqa: E402
from hf_flash.patches import UnsupportedModelError, t5  # noqa: E402


def _t5_small(dtype=torch.float32, impl="eager", **overrides):
    """t5-small's real config (T5Config's defaults: 6 + 6 layers, d_model 512, 8 heads of 64, 32 buckets, max
    distance 128), random init (the same weights for every implementation); the relative bias scaled up so that
    it shapes every row."""
    config = transformers.T5Config(decoder_start_token_id=0, **overrides)  # t5-small's (the pad token)
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration._from_config(config, attn_implementation=impl).to(dtype).eval()
    with torch.no_grad():
        for m in model.modules():
            if getattr(m, "has_relative_attention_bias", False):
                m.relative_attention_bias.weight.normal_(0, 2.0)
    return model


@pytest.mark.parametrize("cls_name, kw", [
    ("T5Config", {}), ("T5Config", dict(relative_attention_num_buckets=64, relative_attention_max_distance=256)),
    ("UMT5Config", {}), ("LongT5Config", {}), ("SwitchTransformersConfig", dict(num_layers=1, num_decoder_layers=1))])
@pytest.mark.parametrize("is_decoder", [False, True])
def test_table_is_the_models_bias_at_every_distance(cls_name, kw, is_decoder):
    """The (H, 2R + 1) table read at clamp(d, -R, R) equals the module's own compute_bias at every distance d,
    far beyond R too: T5's buckets saturate at max_distance, the rule the kernels rely on."""
    config = getattr(transformers, cls_name)(d_model=64, num_heads=4, d_kv=16, d_ff=64, is_decoder=is_decoder, **kw)
    module_cls = {"T5Config": "T5Attention", "UMT5Config": "UMT5Attention", "LongT5Config": "LongT5Attention",
                  "SwitchTransformersConfig": "SwitchTransformersAttention"}[cls_name]
    modeling = __import__(type(config).__module__.replace("configuration", "modeling"), fromlist=[module_cls])
    module = getattr(modeling, module_cls)(config, has_relative_attention_bias=True, layer_idx=0)
    torch.nn.init.normal_(module.relative_attention_bias.weight)
    table = t5.table(module)
    r = config.relative_attention_max_distance
    assert table.shape == (4, 2 * r + 1)
    q_len, k_len = 7, 5 * r  # queries at positions 3r .. 3r + 6: distances -3r - 6 .. 2r
    dense = module.compute_bias(q_len, k_len, past_seen_tokens=3 * r)[0]  # (H, q, k)
    d = torch.arange(k_len)[None, :] - (torch.arange(q_len)[:, None] + 3 * r)
    torch.testing.assert_close(table[:, d.clamp(-r, r) + r], dense, rtol=0, atol=0)
    # the table carries the embedding's gradient
    table.sum().backward()
    assert module.relative_attention_bias.weight.grad.abs().sum() > 0


def _enc_dec_inputs(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (3, 19), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # right padding, as T5 tokenizers pad
    mask[2, 6:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.slow
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_matches_eager(cache, kernel_calls):
    """Encoder-decoder generation on t5-small's real config: the encoder's bidirectional and the decoder's causal
    bias, the decode steps against the cache and cross-attention over a padded encoder batch give eager's tokens."""
    ids, mask = _enc_dec_inputs(32128)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, disable_compile=True,
                  **({"cache_implementation": "static"} if cache == "static" else {}))
    ref = _t5_small().generate(ids, attention_mask=mask, **kwargs)
    ours = _t5_small(impl="hf_flash").generate(ids, attention_mask=mask, **kwargs)
    assert kernel_calls["fwd"] >= 6 + 11 * 12  # encoder layers, decoder self- and cross-attention every step
    assert torch.equal(ours, ref)


@pytest.mark.slow
def test_training_step_matches_eager(kernel_calls):
    """A training forward with dropout off and labels: loss and the relative bias embeddings' gradients."""
    ids, mask = _enc_dec_inputs(32128)
    labels = torch.randint(3, 32128, (3, 9), generator=torch.Generator().manual_seed(2))
    grads = {}
    for impl in ("eager", "hf_flash"):
        model = _t5_small(impl=impl, num_layers=2, num_decoder_layers=2)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grads[impl] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()
                                       if "relative_attention_bias" in n})
    assert kernel_calls["fwd"] == 6 and kernel_calls["bwd"] == 6
    torch.testing.assert_close(grads["hf_flash"][0], grads["eager"][0], rtol=1e-5, atol=1e-5)
    assert set(grads["hf_flash"][1]) == set(grads["eager"][1]) and len(grads["eager"][1]) == 2
    for name, g in grads["eager"][1].items():
        torch.testing.assert_close(grads["hf_flash"][1][name], g, rtol=1e-4, atol=1e-5)


def test_longt5_transient_global_refuses_at_load():
    config = transformers.LongT5Config(d_model=64, num_heads=4, d_kv=16, d_ff=64, num_layers=1,
                                       encoder_attention_type="transient-global")
    with pytest.raises(UnsupportedModelError, match="'longt5'.*transient-global"):
        transformers.LongT5ForConditionalGeneration._from_config(config, attn_implementation="hf_flash")


def test_pop2piano_matches_eager(kernel_calls):
    """Pop2Piano (T5's attention over audio features; not a text model, so not in the coverage sweep)."""
    config = transformers.Pop2PianoConfig(d_model=64, num_heads=4, d_kv=16, d_ff=64, num_layers=2,
                                          num_decoder_layers=2, vocab_size=128, composer_vocab_size=4,
                                          dropout_rate=0.0)
    features = torch.randn(2, 11, 64, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    decoder_ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    outs = {}
    for impl in ("eager", "hf_flash"):
        torch.manual_seed(0)
        model = transformers.Pop2PianoForConditionalGeneration._from_config(config, attn_implementation=impl)
        logits = model(input_features=features, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        logits.sum().backward()
        outs[impl] = (logits.detach(), [p.grad for p in model.parameters() if p.grad is not None])
    assert kernel_calls["fwd"] == 6
    torch.testing.assert_close(outs["hf_flash"][0], outs["eager"][0], rtol=1e-4, atol=5e-5)
    for a, b in zip(outs["hf_flash"][1], outs["eager"][1]):
        torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-4)


def test_dense_position_bias_from_an_unpatched_module_is_refused():
    from hf_flash.integration import UnsupportedAttentionError, attention_forward

    q = torch.randn(1, 2, 5, 8)
    with pytest.raises(UnsupportedAttentionError, match="position_bias"):
        attention_forward(torch.nn.Linear(1, 1), q, q, q, None, position_bias=torch.zeros(1, 2, 5, 5))


# ----------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_generate_and_logits_near_eager(dtype):
    """t5-small's real config in half precision on the kernels: teacher-forced logits as close to fp32 eager as
    eager in the same dtype is, and greedy tokens that are greedy under fp32 eager."""
    ids, mask = (t.cuda() for t in _enc_dec_inputs(32128))
    model = _t5_small(dtype, "hf_flash").cuda()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False,
                         disable_compile=True)
    ref_model = _t5_small(torch.float32).cuda()
    same = _t5_small(dtype).cuda()
    with torch.no_grad():
        ref = ref_model(input_ids=ids, attention_mask=mask, decoder_input_ids=out[:, :-1]).logits.float()
        base = same(input_ids=ids, attention_mask=mask, decoder_input_ids=out[:, :-1]).logits.float()
        ours = model(input_ids=ids, attention_mask=mask, decoder_input_ids=out[:, :-1]).logits.float()
    base_err = (base - ref).abs().max().item()
    err = (ours - ref).abs().max().item()
    assert err <= 3 * base_err + 1e-3, f"hf_flash error {err} vs eager {dtype} error {base_err}"
    ref[..., model.config.eos_token_id] = -float("inf")  # min_new_tokens keeps generate from choosing it
    chosen = ref.gather(-1, out[:, 1:, None]).squeeze(-1)  # logits at i chose token i + 1
    assert (chosen >= ref.max(-1).values - 4 * base_err - 1e-3).all(), "a generated token is not greedy"


@pytest.mark.gpu
def test_gpu_training_gradients_near_eager():
    """A bf16 training step of a 2 + 2 layer t5-small (attention dropout off): every parameter's gradient, the
    relative bias embeddings' included, as close to fp32 eager as eager in bf16 is."""
    ids, mask = (t.cuda() for t in _enc_dec_inputs(32128))
    labels = torch.randint(3, 32128, (3, 9), generator=torch.Generator().manual_seed(2)).cuda()
    grads = {}
    for name, dtype, impl in (("ref", torch.float32, "eager"), ("same", torch.bfloat16, "eager"),
                              ("ours", torch.bfloat16, "hf_flash")):
        model = _t5_small(dtype, impl, num_layers=2, num_decoder_layers=2).cuda()
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        grads[name] = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    assert sum("relative_attention_bias" in n for n in grads["ours"]) == 2
    for n, ref in grads["ref"].items():
        base = (grads["same"][n] - ref).abs().max().item()
        err = (grads["ours"][n] - ref).abs().max().item()
        assert err <= 3 * base + 1e-3 * ref.abs().max().item(), f"{n}: {err} vs eager bf16 {base}"
