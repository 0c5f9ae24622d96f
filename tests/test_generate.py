"""Generation through hf_flash: decode steps run the KV-cache op on transformers' own cache.

CPU tests (tiny random-init fp32 models from test_transformers.py): greedy tokens identical to eager
for dynamic and static caches with left padding, sliding windows and softcap; the decode path is taken
and transformers' unpadding (``_upad_input``) is not; masks whose ones are not one run (right padding
then generation) match eager through the fallback; continuous batching matches ``generate``.
GPU tests: the same on CUDA in fp16 against an fp32 reference, and transformers' automatic
``torch.compile`` of static-cache decoding with no graph breaks and CUDA graphs in use.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from test_transformers import CAUSAL, LAYERS, LENGTHS, SEQ, build, data, padding_mask  # noqa: E402

from hf_flash import integration, ops  # noqa: E402

NEW = 8  # new tokens: with SEQ = 12 and WINDOW = 4, sliding caches are full from the first step


@pytest.fixture
def paths(monkeypatch):
    """Counts decode-path calls (the KV-cache op) and transformers' unpadding, by query length."""
    from transformers import modeling_flash_attention_utils as mfau

    seen = {"kvcache": 0, "unpad_q_lens": [], "mask_shapes": []}
    kvcache, upad, key_ranges = ops.run_fwd_kvcache, mfau._upad_input, integration._key_ranges

    def spy_kvcache(*args, **kwargs):
        seen["kvcache"] += 1
        return kvcache(*args, **kwargs)

    def spy_upad(q, k, v, mask, query_length, *args):
        seen["unpad_q_lens"].append(query_length)
        return upad(q, k, v, mask, query_length, *args)

    def spy_key_ranges(mask, query):
        seen["mask_shapes"].append((query.shape[2], None if mask is None else tuple(mask.shape)))
        return key_ranges(mask, query)

    monkeypatch.setattr(ops, "run_fwd_kvcache", spy_kvcache)
    monkeypatch.setattr(mfau, "_upad_input", spy_upad)
    monkeypatch.setattr(integration, "_key_ranges", spy_key_ranges)
    return seen


def prompts(side: str):
    ids, _ = data()
    mask = padding_mask(side)
    return ids.masked_fill(mask == 0, 0), mask


def greedy(model, ids, mask, cache: str, **kwargs):
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **kwargs)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, **kwargs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", CAUSAL)
def test_greedy_generate_left_padded(name, cache, kernel_calls, paths):
    ids, mask = prompts("left")
    ours = greedy(build(name, "hf_flash"), ids, mask, cache)
    calls, decode_calls = kernel_calls["fwd"], paths["kvcache"]
    ref = greedy(build(name, "eager"), ids, mask, cache)
    assert calls == NEW * LAYERS  # prefill + every decode step went through hf_flash
    assert decode_calls >= (NEW - 1) * LAYERS  # every decode step took the cache path ...
    assert set(paths["unpad_q_lens"]) <= {SEQ}  # ... and only a prefill used transformers' unpadding
    assert ours.shape == (len(LENGTHS), SEQ + NEW)
    assert torch.equal(ours, ref), f"{name} {cache}: hf_flash {ours[:, SEQ:].tolist()} vs eager {ref[:, SEQ:].tolist()}"


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_split_mask_generate_falls_back(cache, kernel_calls, paths):
    """Masks of ones, zeros, ones (padding inside the prompt, or right padding followed by generated
    tokens): no [start, end) range describes them, so those steps go through transformers' unpadding
    and still match eager. Not compared: right padding proper, where eager predicts the first token
    from a padding position (any flash backend differs), and sliding windows over such masks, which
    transformers' wrapper measures in unpadded positions."""
    name = "llama"
    ids, _ = data()
    mask = torch.ones_like(ids)
    mask[1, 4:9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ours = greedy(build(name, "hf_flash"), ids, mask, cache)
    assert kernel_calls["fwd"] == NEW * LAYERS
    assert paths["unpad_q_lens"].count(1) > 0  # decode steps fell back
    ref = greedy(build(name, "eager"), ids, mask, cache)
    assert torch.equal(ours, ref), f"{name} {cache}: hf_flash {ours[:, SEQ:].tolist()} vs eager {ref[:, SEQ:].tolist()}"


@pytest.mark.parametrize("padded", [False, True])
def test_prompt_lookup_generate(padded, paths):
    """Speculative steps (several candidate tokens against the cache, then a cache crop) take the
    decode path and give eager's greedy tokens."""
    ids, _ = data()
    ids = ids[:1].repeat(1, 2)  # repeats give the prompt lookup candidates to verify
    mask = torch.ones_like(ids)
    if padded:
        ids[:, :3], mask[:, :3] = 0, 0
    kwargs = dict(prompt_lookup_num_tokens=4, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                  attention_mask=mask)
    with torch.no_grad():
        ours = build("llama", "hf_flash").generate(ids, **kwargs)
        ref = build("llama", "eager").generate(ids, **kwargs)
    assert any(q_len > 1 for q_len, _ in paths["mask_shapes"]), "no multi-token step"
    assert torch.equal(ours, ref), f"hf_flash {ours[:, ids.shape[1]:].tolist()} vs eager {ref[:, ids.shape[1]:].tolist()}"


def test_static_decode_masks_have_one_shape(paths):
    """Single-token steps on a static cache see a mask padded to the cache length: one compiled graph."""
    ids, mask = prompts("left")
    greedy(build("llama", "hf_flash"), ids, mask, "static")
    decode = {shape for q_len, shape in paths["mask_shapes"] if q_len == 1}
    assert decode == {(len(LENGTHS), SEQ + NEW - 1)}  # the cache length; unpadded masks grow from SEQ + 1


def test_static_cache_compiled_decode_is_one_graph(kernel_calls):
    """transformers' compilation of static-cache decode steps (forced on CPU, aot_eager: dynamo's graph
    without inductor): every step replays one graph (the padded mask keeps its shape), none of our
    code breaks it, and the tokens are eager's."""
    from torch._dynamo.utils import counters

    ids, mask = prompts("left")
    config = transformers.CompileConfig(backend="aot_eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters.clear()
    ours = greedy(build("llama", "hf_flash"), ids, mask, "static", compile_config=config)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert kernel_calls["fwd"] == NEW * LAYERS  # traced once, then run by the graph every step
    assert torch.equal(ours, greedy(build("llama", "eager"), ids, mask, "static"))


def _eager_attention(q, k, v, mask, end, window, softcap, scale):
    """Reference on (B, H, S, D) float64: query i of row b sits at cache index end[b] - Sq + i."""
    b, h, sq, _ = q.shape
    k = k.repeat_interleave(h // k.shape[1], 1).double()
    v = v.repeat_interleave(h // v.shape[1], 1).double()
    s = q.double() @ k.transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    pos_q = end[:, None] - sq + torch.arange(sq)  # (B, Sq)
    pos_k = torch.arange(k.shape[2])
    visible = mask[:, None, :] & (pos_k[None, None] <= pos_q[..., None])
    if window is not None:
        visible &= pos_q[..., None] - pos_k[None, None] < window
    s = s.masked_fill(~visible[:, None], float("-inf"))
    return torch.nan_to_num(s.softmax(-1)) @ v


MASKS = {  # (mask over the cache, valid end = position of the last query + 1): rows of B = 3, cache 10
    "left": ([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1] * 10, [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]], 10),
    "static tail": ([[0, 1, 1, 1, 1, 1, 1, 0, 0, 0], [1] * 7 + [0] * 3, [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]], 7),
}


@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("window,softcap", [(None, 0.0), (3, 0.0), (None, 2.0), (4, 1.5)])
@pytest.mark.parametrize("mask_kind", list(MASKS))
def test_decode_path_matches_eager_math(mask_kind, window, softcap, q_len, paths):
    """attention_forward's decode path against masked softmax attention over the whole cache."""
    rows, end = MASKS[mask_kind]
    mask = torch.tensor(rows, dtype=torch.bool)
    if q_len > 1 or mask_kind == "left":  # transformers' masks for longer steps stop at the last query
        mask = mask[:, :end]
    module = build("llama", "hf_flash").model.layers[0].self_attn
    b, h, hk, d, s = 3, 4, 2, 16, 10
    q, k, v = torch.randn(b, h, q_len, d), torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    with torch.no_grad():
        out, _ = integration.attention_forward(module, q, k, v, mask, scaling=0.3, dropout=0.0,
                                               sliding_window=window, softcap=softcap)
    assert paths["kvcache"] == 1
    full = torch.zeros(b, s, dtype=torch.bool)
    full[:, :mask.shape[1]] = mask
    ref = _eager_attention(q, k, v, full, torch.full((b,), end), window, softcap, 0.3).transpose(1, 2)
    valid = full[:, end - q_len:end]  # query rows that are not padding
    torch.testing.assert_close(out[valid], ref[valid].float(), atol=2e-6, rtol=1e-5)


def test_split_mask_under_compile_gives_nan(monkeypatch, paths):
    """When the step cannot be checked on the host (compilation, CUDA graph capture), rows whose mask
    is not one run of ones come out NaN instead of a wrong number; the other rows are exact."""
    monkeypatch.setattr(integration, "_capturing", lambda t: True)
    module = build("llama", "hf_flash").model.layers[0].self_attn
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    q, k, v = torch.randn(2, 4, 1, 16), torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    with torch.no_grad():
        out, _ = integration.attention_forward(module, q, k, v, mask, scaling=0.25, dropout=0.0)
    assert paths["kvcache"] == 1 and not paths["unpad_q_lens"]
    assert out[0].isnan().all()
    ref = _eager_attention(q, k, v, mask, torch.full((2,), 6), None, 0.0, 0.25).transpose(1, 2)
    torch.testing.assert_close(out[1], ref[1].float(), atol=2e-6, rtol=1e-5)


def test_training_and_prefill_keep_the_wrapper(paths):
    """Steps that need gradients, and prompts without a cache, are not decode steps."""
    module = build("llama", "hf_flash").model.layers[0].self_attn
    q = torch.randn(2, 4, 1, 16, requires_grad=True)
    k, v = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    out, _ = integration.attention_forward(module, q, k, v, None, scaling=0.25, dropout=0.0)
    out.sum().backward()
    assert q.grad is not None and paths["kvcache"] == 0
    ids, mask = prompts("left")
    with torch.no_grad():
        build("llama", "hf_flash")(input_ids=ids[:, :8], attention_mask=mask[:, :8])
    assert paths["kvcache"] == 0


def test_continuous_batching_matches_generate(kernel_calls):
    """generate_batch (paged cache; transformers 5.17 asks for "paged|hf_flash", 5.23 passes the cache
    to our function) gives each request's greedy tokens, through hf_flash."""
    model = build("llama", "hf_flash")
    ids, _ = data()
    requests = [ids[0].tolist(), ids[1, :7].tolist()]
    config = transformers.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate_batch(inputs=requests, generation_config=config)
        assert kernel_calls["fwd"] > 0
        ref = build("llama", "eager")
        for request_id, prompt in zip(sorted(batched, key=lambda r: int(r.split("_")[-1])), requests):
            expected = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False)[0, len(prompt):]
            assert batched[request_id].generated_tokens == expected.tolist()


# ----------------------------------------------------------------------------------------------- GPU

GPU_MODELS = {  # head dims the kernels compile, windows and softcap that bite at these lengths
    "llama": dict(),
    "mistral": dict(sliding_window=24),
    "gemma2": dict(sliding_window=24, attn_logit_softcapping=20.0, final_logit_softcapping=None,
                   query_pre_attn_scalar=64),
    "gpt_oss": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"], num_local_experts=4,
                    num_experts_per_tok=2),  # learned sinks
    "gemma4_text": dict(sliding_window=24, layer_types=["sliding_attention", "full_attention"],
                        per_layer_config={"1": {"head_dim": 512}}, hidden_size_per_layer_input=0,
                        final_logit_softcapping=None),  # a d512 global layer
}
GPU_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
               "gemma4_text": ("Gemma4TextConfig", "Gemma4ForCausalLM")}


def _gpu_model(name: str, dtype):
    config_cls, model_cls = (getattr(transformers, c) for c in GPU_CLASSES[name])
    config = config_cls(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=16384, initializer_range=0.05, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **GPU_MODELS[name])
    torch.manual_seed(0)
    return model_cls._from_config(config, attn_implementation="hf_flash", dtype=dtype).cuda().eval()


def _gpu_prompts(batch: int = 4, length: int = 40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 512, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 5, 17, 39)[:batch]):  # with 4 rows of 40, the last has a single token
        mask[row, :pad] = 0
    return ids.masked_fill(mask == 0, 0).cuda(), mask.cuda()


def _check_near_greedy(name, sequences, logits, mask, dtype):
    """Every generated token is greedy under an fp32 reference run teacher-forced on the same tokens,
    and the step logits match that reference about as well as eager attention in the same dtype does."""
    prompt = mask.shape[1]
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, prompt:])], dim=1)
    step_logits = {}
    for impl, model_dtype in (("eager", torch.float32), ("eager", dtype)):
        model = _gpu_model(name, model_dtype)
        model.set_attn_implementation(impl)
        with torch.no_grad():
            step_logits[model_dtype] = model(input_ids=sequences, attention_mask=full_mask).logits[:, prompt - 1:-1].float()
    ref = step_logits[torch.float32]
    base_err = (step_logits[dtype] - ref).abs().max().item()
    ours = torch.stack(logits, dim=1).float()
    err = (ours - ref).abs().max().item()
    assert err <= 3 * base_err + 1e-3, f"{name}: hf_flash error {err} vs eager {dtype} error {base_err}"
    chosen = ref.gather(-1, sequences[:, prompt:, None]).squeeze(-1)
    assert (chosen >= ref.max(-1).values - 4 * base_err - 1e-3).all(), f"{name}: a generated token is not greedy"


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", list(GPU_MODELS))
def test_gpu_greedy_generate(name, cache, paths):
    ids, mask = _gpu_prompts()
    model = _gpu_model(name, torch.float16)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, disable_compile=True,
                         **({"cache_implementation": "static"} if cache == "static" else {}))
    assert paths["kvcache"] >= 23 * 2
    assert set(paths["unpad_q_lens"]) <= {ids.shape[1]}
    _check_near_greedy(name, out.sequences, out.logits, mask, torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("batch,length", [(4, 40), (1, 8192)])  # a long cache: inductor splits the mask reductions
def test_gpu_static_cache_compiled_decode(batch, length, paths):
    """transformers compiles the decode step of a static cache (mode reduce-overhead): our ops must
    not break the graph, nor keep CUDA graphs from being used, and the tokens stay greedy."""
    from torch._dynamo.utils import counters

    ids, mask = _gpu_prompts(batch, length)
    model = _gpu_model("llama", torch.float16)
    torch._dynamo.reset()
    counters.clear()
    out = model.generate(ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, cache_implementation="static")
    assert counters["stats"]["unique_graphs"] >= 1, "the decode step was not compiled"
    assert paths["kvcache"] > 0  # traced through the decode path
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["inductor"]["cudagraph_skips"] == 0, "CUDA graphs were skipped"
    _check_near_greedy("llama", out.sequences, out.logits, mask, torch.float16)
