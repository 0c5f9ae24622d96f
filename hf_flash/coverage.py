"""Coverage sweep: does every transformers text model run on hf_flash, or refuse clearly?

``python -m hf_flash coverage [--markdown] [--only TYPE ...] [--no-backward]``

For every text model type of the installed transformers, a tiny random-init
fp32 model (2 layers, hidden 64, 4 heads) is built twice from one seed, with
``eager`` and with ``hf_flash``, and run on a right-padded batch of two
(lengths 11 and 7). Each type lands in one class:

* ``match``: logits on valid tokens and all parameter gradients agree, and
  hf_flash's kernel ran once per attention call (no layer ran eager math);
* ``refusal``: loading with ``hf_flash`` raised a clear error naming the model
  type (``hf_flash.patches.UnsupportedModelError``), also when eager cannot
  run the type on its own (a speculative-decoding drafter);
* ``mismatch``: outputs or gradients differ;
* ``silent-eager``: hf_flash loaded and ran, but some attention did not go
  through its kernel (too few kernel calls, or a softmax over attention
  scores / an sdpa call was seen during the forward);
* ``crash``: anything else raised (at load, in forward or in backward);
* ``skipped``: not a text model (vision/audio/multimodal), with the reason;
* ``untestable``: even ``eager`` cannot run the tiny config (a harness gap,
  listed with its error: a ``FIXUPS`` entry closes it).

The CI test (``tests/test_coverage.py``) fails on any mismatch, silent-eager,
crash or untestable type. Nothing is cached on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import inspect
import os
import re
import sys
import time
import traceback
from typing import Optional

import torch

SEQ, LENGTHS, DEC_SEQ = 11, (11, 7), 9  # odd lengths, distinct from every other dim: spots score softmaxes
VOCAB = 128
LOGITS_TOL = dict(atol=5e-5, rtol=1e-4)
GRAD_TOL = dict(atol=2e-4, rtol=2e-3)
FAIL_CLASSES = ("mismatch", "silent-eager", "crash")
CLASSES = ("match", "refusal", "mismatch", "silent-eager", "crash", "untestable", "skipped")

# Generic shrinking: every config attribute of these names present in the default config is overridden.
_SHRINK = {
    2: ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "encoder_layers", "decoder_layers",
        "num_decoder_layers", "num_encoder_layers", "n_layers_decoder"),
    64: ("hidden_size", "n_embd", "d_model", "dim", "embed_dim", "n_embed", "word_embed_proj_dim",
         "embedding_size", "d_embed", "emb_dim"),
    4: ("num_attention_heads", "n_head", "num_heads", "encoder_attention_heads", "decoder_attention_heads",
        "n_heads", "mamba_n_heads", "num_local_experts", "num_experts", "n_routed_experts"),
    2.5: ("num_key_value_heads", "num_experts_per_tok", "n_kv_heads", "multi_query_group_num"),
    128: ("intermediate_size", "ffn_dim", "n_inner", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
          "hidden_dim", "ffn_hidden_size", "inner_hidden_size", "d_inner"),
    16: ("ssm_state_size", "mamba_d_state", "state_size", "d_state", "head_dim", "d_kv", "d_head", "moe_intermediate_size", "shared_expert_intermediate_size",
         "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"),
    VOCAB: ("vocab_size",),
    8: ("rotary_dim", "rotary_emb_base_dim"),
    16.5: ("mamba_chunk_size", "chunk_size"),
    64.5: ("max_position_embeddings", "n_positions", "max_seq_len", "n_ctx", "max_sequence_length"),
}
_DROPOUT = re.compile(r"(dropout|drop_rate|_pdrop|dropout_prob|dropout_rate)$")
_TOKEN_ID = re.compile(r"_token_id$")
# Per-type corrections for configs whose defaults tie several sizes together.
FIXUPS: dict[str, dict] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    # one linear-attention layer, then one full-attention layer (MLA: kv heads = query heads)
    "bailing_hybrid": {"layer_group_size": 2, "num_key_value_heads": 4},
    # hybrids: a mamba layer, then a layer with softmax attention
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
              "mamba_dt_rank": 4},
    "zamba": {"layers_block_type": ["hybrid", "hybrid"], "attention_head_dim": 16, "mamba_dt_rank": 4},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1], "attention_head_dim": 16,
               "mamba_headdim": 16, "kv_channels": 16, "num_query_groups": 4},
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"], "linear_key_head_dim": 16,
                         "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "lru_width": 64},
    "zaya": {"layer_types": ["hybrid", "hybrid"], "num_experts_per_tok": 1},
    "gemma3n_text": {"layer_types": ["sliding_attention", "full_attention"], "num_kv_shared_layers": 0,
                     "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
                     "activation_sparsity_pattern": [0.0, 0.0]},
    "kimi_linear": {"layer_types": ["linear_attention", "full_attention"], "mlp_layer_types": ["dense", "sparse"],
                    "num_experts_per_token": 2, "linear_head_dim": 16, "linear_num_heads": 4},
    "qwen4_exp_text": {"layer_types": ["linear_attention", "qwen_sparse_attention"], "linear_key_head_dim": 16,
                       "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                       "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 4,
                       "indexer_compress_ratio": 1, "ngram_vocab_size_base": 256},
    "lfm3": {"layer_types": ["conv", "full_attention"]},
    "gemma4_assistant": {"text_config": {  # a drafter over a Gemma 4 text stack without per-layer inputs
        "model_type": "gemma4_text", "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
        "enable_moe_block": False, "use_double_wide_mlp": False, "vocab_size": VOCAB, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "global_head_dim": 16}},
    # 5.24's drafter over a full-size Gemma 4 unified text stack (2.9B parameters by default: minutes on CPU)
    "gemma4_unified_assistant": {"backbone_hidden_size": 64, "num_centroids": 16, "centroid_intermediate_top_k": 4,
                                 "text_config": {
        "model_type": "gemma4_unified_text", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"], "per_layer_config": {"1": {"head_dim": 16}},
        "num_kv_shared_layers": 2, "sliding_window": 4}},
    # its feed-forward and expert sizes are not the generic names (146M parameters otherwise: ~30 s on CPU)
    "longcat_flash": {"ffn_hidden_size": 128, "expert_ffn_hidden_size": 32, "moe_topk": 2, "zero_expert_num": 2},
    "mamba2": {"num_heads": 8, "n_groups": 1},  # num_heads * head_dim = 2 * hidden
    "longt5": {"local_radius": 3},  # the encoder's local window bites at these lengths (default 127)
    # per-layer-type rotary tables (mrope sections sum to head_dim / 2)
    "cohere_compass_text": {"layer_types": ["sliding_attention", "full_attention"], "rope_parameters": {
        t: {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]}
        for t in ("sliding_attention", "full_attention")}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": 64, "ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 1}},
    "esm": {"pad_token_id": 1, "mask_token_id": 2},  # padded positions come from pad_token_id
    "esmc": {"num_key_value_heads": 4},  # no grouped-query attention
    "lilt": {"hidden_size": 96},  # its layout embeddings split hidden_size in six
    "xmod": {"default_language": "en_XX"},  # language adapters need a language
    "nllb-moe": {"encoder_sparse_step": 2, "decoder_sparse_step": 2},  # one MoE layer in each stack
    # NoNorm (an elementwise affine, no normalisation) at the generic init range saturates the softmax:
    # gradients then differ between eager and sdpa by 100x; the default init keeps them comparable
    "mobilebert": {"initializer_range": 0.02},
}


# text models that a document mapping lists too: their layout inputs (boxes) are optional
_OPTIONAL_LAYOUT = {"layoutlm"}


@dataclasses.dataclass
class Result:
    model_type: str
    status: str
    detail: str = ""
    seconds: float = 0.0


def text_model_types() -> dict[str, Optional[str]]:
    """{model_type: skip reason or None} for every type with a text head in the installed transformers."""
    from transformers.models.auto import modeling_auto as ma

    heads = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
             "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
    multimodal = set()
    for name in dir(ma):
        if name.endswith("_MAPPING_NAMES") and any(w in name for w in (
                "IMAGE", "VISION", "VIDEO", "VISUAL", "AUDIO", "SPEECH", "CTC", "RNNT", "TDT", "MULTIMODAL",
                "TEXT_TO_WAVEFORM", "TEXT_TO_SPECTROGRAM", "TEXT_RECOGNITION", "DOCUMENT", "TABLE_RECOGNITION",
                "OBJECT", "DEPTH", "SEMANTIC", "UNIVERSAL_SEG", "INSTANCE_SEG", "MASK_GENERATION", "BACKBONE",
                "NORMAL_ESTIMATION", "POINTMAP", "POSE", "ZERO_SHOT", "KEYPOINT", "TIME_SERIES")):
            multimodal.update(getattr(ma, name))
    types = {}
    for head in heads:
        for model_type in getattr(ma, head):
            types.setdefault(model_type, None)
    for model_type in types:
        if model_type in multimodal and model_type not in _OPTIONAL_LAYOUT:
            types[model_type] = "multimodal/vision/audio model (listed in a non-text auto mapping)"
    return dict(sorted(types.items()))


def _sub_config_reason(config) -> Optional[str]:
    subs = getattr(config, "sub_configs", None) or {}
    non_text = [k for k in subs if re.search(r"vision|audio|image|video|speech|visual|vq|codec|speaker|"
                                             r"perceiver|projector|mm_|depth|pixel|patch", k)]
    if non_text:
        return f"multimodal config (sub-configs: {', '.join(sorted(non_text))})"
    return None


def _shrunk(defaults: dict) -> dict:
    """Overrides that shrink one config's defaults (sizes, dropout, token ids, windows)."""
    kw = {}
    for value, names in _SHRINK.items():
        for name in names:
            if name in defaults and defaults[name] is not None and not isinstance(defaults[name], (list, dict)):
                kw[name] = int(value)
    for name, value in defaults.items():
        if _DROPOUT.search(name) and isinstance(value, float):
            kw[name] = 0.0
        elif _TOKEN_ID.search(name) and isinstance(value, int) and value >= VOCAB:
            kw[name] = VOCAB - 1 - (hash(name) % 8)
        elif name in ("sliding_window", "window_size", "attention_window", "local_window_size") and (
                isinstance(value, int) and value > 0):
            kw[name] = 4
    # sizes whose default is None (derived from the full-size config elsewhere, or required from checkpoints)
    for name, value in (("head_dim", 16), ("num_key_value_heads", 2), ("num_experts_per_tok", 2),
                        ("vocab_size", VOCAB), ("n_routed_experts", 4), ("n_shared_experts", 1)):
        if name in defaults and defaults[name] is None:
            kw[name] = value
    if "kv_lora_rank" in defaults:  # MLA: keys/values are expanded to every query head (kv heads = heads)
        kw["num_key_value_heads"] = kw.get("num_attention_heads", 4)
    if isinstance(defaults.get("n_group"), int):  # grouped MoE routing: one group of the 4 experts
        kw.update(n_group=1, topk_group=1)
    if "attn_layer_indices" in defaults:  # hybrids: one attention layer of the two
        kw["attn_layer_indices"] = [1]
    if "initializer_range" in defaults:
        kw["initializer_range"] = 0.2
    return kw


def tiny_config(model_type: str):
    """The type's default config, shrunk to 2 layers / hidden 64 / 4 heads, no dropout."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    if model_type == "encoder-decoder":  # a composite of two sub-configs (5.23's default: two full-size BERTs)
        decoder = tiny_config("bert")
        decoder.is_decoder = decoder.add_cross_attention = True
        return cls.from_encoder_decoder_configs(tiny_config("bert"), decoder)
    fixups = FIXUPS.get(model_type, {})
    try:
        defaults = cls().to_dict()
    except Exception:  # a default config that fails its own validation (5.23's gemma4_assistant)
        defaults = cls(**fixups).to_dict()
    kw = _shrunk(defaults)
    # text sub-configs built from their own full-size defaults (t5gemma's encoder/decoder, dbrx's attn/ffn)
    subs = {}
    for name, sub_cls in (getattr(cls, "sub_configs", None) or {}).items():
        if isinstance(defaults.get(name), dict) and name not in fixups:
            with contextlib.suppress(Exception):
                sub = sub_cls().to_dict()
                sub.pop("layer_types", None)  # per-layer lists of the full depth: derived again from the 2 layers
                subs[name] = {**sub, **_shrunk(sub)}
    try:
        return cls(**{**kw, **subs, **fixups})
    except Exception:  # sub-configs that do not shrink on their own (moshi's audio vocabulary): left full size
        return cls(**{**kw, **fixups})


def _model_class(model_type: str, config):
    from transformers.models.auto import modeling_auto as ma

    for name, auto in (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
                       ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
                       ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
                       ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForSequenceClassification")):
        if model_type in getattr(ma, name):
            import transformers

            return getattr(transformers, auto)
    raise KeyError(model_type)


def build(model_type: str, config, impl: str):
    torch.manual_seed(0)
    return _model_class(model_type, config).from_config(config, attn_implementation=impl)


def _inputs(model, config):
    g = torch.Generator().manual_seed(1)
    vocab = getattr(config, "vocab_size", VOCAB) or VOCAB
    ids = torch.randint(3, min(vocab, VOCAB), (len(LENGTHS), SEQ), generator=g)
    mask = (torch.arange(SEQ)[None] < torch.tensor(LENGTHS)[:, None]).long()
    ids = ids.masked_fill(mask == 0, 0 if getattr(config, "pad_token_id", None) is None else config.pad_token_id)
    inputs = {"input_ids": ids, "attention_mask": mask}
    params = inspect.signature(model.forward).parameters
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = torch.randint(3, min(vocab, VOCAB), (len(LENGTHS), DEC_SEQ), generator=g)
    return inputs, mask.bool()


def _output(model, inputs):
    out = model(**inputs, use_cache=False) if "use_cache" in inspect.signature(model.forward).parameters \
        else model(**inputs)
    return out.logits


def _forward_backward(model, inputs, mask, backward: bool, forward_context=contextlib.nullcontext()):
    """Valid-position outputs of one forward (inside ``forward_context``), then a backward of a scalar loss."""
    with forward_context:
        out = _valid(_output(model, inputs), mask, inputs)
    if backward:
        out.float().pow(2).mean().backward()
    return out


def _valid(logits, mask, inputs):
    """Logits of real tokens: padded positions differ by design (flash leaves them at zero)."""
    if logits.dim() == 3 and logits.shape[1] == SEQ and "decoder_input_ids" not in inputs:
        return logits[mask]  # a decoder-only head of an encoder-decoder type too (PegasusForCausalLM)
    return logits  # sequence classification / decoder logits: every position is valid


_ATTENTION_NAME = re.compile(r"(Attention|Attn)$|SelfAttention|MultiHeadAttention")


_NOT_SOFTMAX = re.compile(r"Linear|Lightning|Mamba|Recurrent|Retention|Gated|Delta|Conv|Fourier|Mixer")


def _leaf_attention_modules(model):
    mods = [m for m in model.modules()
            if _ATTENTION_NAME.search(type(m).__name__) and not _NOT_SOFTMAX.search(type(m).__name__)]
    return [m for m in mods if not any(c is not m and _ATTENTION_NAME.search(type(c).__name__)
                                       for c in m.modules())]


class _ScoreSoftmaxSpy(torch.overrides.TorchFunctionMode):
    """Flags eager attention math: a softmax over a last dim of a sequence length, or an sdpa call."""

    LENGTHS = {SEQ, DEC_SEQ}

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("softmax", "_softmax", "log_softmax") and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            dim = kwargs.get("dim", args[1] if len(args) > 1 else -1)
            if t.dim() >= 3 and isinstance(dim, int) and t.shape[dim] in self.LENGTHS and t.shape[-2] in self.LENGTHS:
                self.seen.append(f"{name}{tuple(t.shape)}")
        elif name == "scaled_dot_product_attention" and len(args) > 1 and isinstance(args[1], torch.Tensor):
            # over a sequence's keys only: inkling2's block residuals attend over layer outputs, not tokens
            if args[1].dim() >= 2 and args[1].shape[-2] in self.LENGTHS:
                self.seen.append(f"scaled_dot_product_attention{tuple(args[1].shape)}")
        elif name == "scaled_dot_product_attention":
            self.seen.append("scaled_dot_product_attention")
        return func(*args, **kwargs)


@contextlib.contextmanager
def _count_kernel_calls():
    """Counts forward calls of the CPU path (hf_flash.reference.fwd) and the backward passes through their
    outputs (the reference path is differentiated by autograd: a hook on each output counts its gradient)."""
    import hf_flash.reference as ref

    calls = {"fwd": 0, "bwd": 0}
    original = ref.fwd

    def count_bwd(grad):
        calls["bwd"] += 1

    def spy(*args, **kwargs):
        calls["fwd"] += 1
        out, lse = original(*args, **kwargs)
        if out.requires_grad:
            out.register_hook(count_bwd)
        return out, lse

    ref.fwd = spy
    try:
        yield calls
    finally:
        ref.fwd = original


def _first_line(e: BaseException) -> str:
    msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {msg}"[:200]


def _reason(e: BaseException) -> str:
    """An UnsupportedModelError's reason, without the boilerplate around it (the table's detail)."""
    found = re.search(r"attn_implementation='hf_flash': (.*?)\. hf_flash runs every", str(e), re.S)
    return found.group(1)[:600] if found else _first_line(e)


def _load_refusal(model_type: str, config) -> Optional[str]:
    """The UnsupportedModelError reason if loading with hf_flash refuses, else None."""
    from hf_flash.patches import UnsupportedModelError

    try:
        build(model_type, copy.deepcopy(config), "hf_flash")
    except UnsupportedModelError as e:
        return _reason(e)
    except Exception:
        pass
    return None


def run_one(model_type: str, backward: bool = True) -> Result:
    import hf_flash  # noqa: F401  (registers the name)
    from hf_flash.patches import UnsupportedModelError

    t0 = time.perf_counter()

    def result(status, detail=""):
        return Result(model_type, status, detail, time.perf_counter() - t0)

    try:
        config = tiny_config(model_type)
    except Exception as e:
        return result("untestable", f"tiny config: {_first_line(e)}")
    reason = _sub_config_reason(config)
    if reason:
        return result("skipped", reason)
    # eager first: if the harness cannot run eager, the type is untestable here, not a failure of ours
    try:
        eager = build(model_type, config, "eager").train(False)
        inputs, mask = _inputs(eager, config)
        eager.zero_grad()
        out_e = _forward_backward(eager, inputs, mask, backward)
    except Exception as e:
        refusal = _load_refusal(model_type, config)  # a clear refusal at load needs no eager reference
        return result("refusal", refusal) if refusal else result("untestable", f"eager: {_first_line(e)}")
    try:
        model = build(model_type, config, "hf_flash").train(False)
    except UnsupportedModelError as e:
        return result("refusal", _reason(e))
    except Exception as e:
        if isinstance(e, ValueError) and "hf_flash" in str(e):  # the model refuses our name, with a clear message
            return result("refusal", _first_line(e))
        return result("crash", f"load: {_first_line(e)}")
    try:
        model.load_state_dict(eager.state_dict(), strict=True)
    except Exception as e:
        return result("crash", f"state-dict keys differ from eager: {_first_line(e)}")
    attn_calls = {"n": 0}
    hooks = [m.register_forward_hook(lambda *a: attn_calls.__setitem__("n", attn_calls["n"] + 1))
             for m in _leaf_attention_modules(model)]
    spy = _ScoreSoftmaxSpy()
    try:
        with _count_kernel_calls() as calls:
            out_f = _forward_backward(model, inputs, mask, backward, forward_context=spy)
    except Exception as e:
        return result("crash", f"forward/backward: {_first_line(e)}")
    finally:
        for h in hooks:
            h.remove()
    if spy.seen:
        return result("silent-eager", f"eager attention math during the hf_flash forward: {spy.seen[0]}")
    if calls["fwd"] == 0 and attn_calls["n"] == 0 and not spy.seen:
        return result("untestable", "the tiny config has no softmax-attention layer (hybrid/recurrent layout)")
    if calls["fwd"] == 0 or calls["fwd"] < attn_calls["n"]:
        return result("silent-eager", f"{calls['fwd']} kernel calls for {attn_calls['n']} attention calls")
    if backward and calls["bwd"] != calls["fwd"]:
        return result("silent-eager", f"{calls['bwd']} backward kernel calls for {calls['fwd']} forward calls")
    try:
        torch.testing.assert_close(out_f, out_e, **LOGITS_TOL)
    except AssertionError as e:
        return result("mismatch", "logits: " + " ".join(str(e).split("\n")[1:3]))
    if backward:
        grads_e = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
        grads_f = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        if grads_e.keys() != grads_f.keys():
            return result("mismatch", f"gradients on different parameters: {sorted(grads_e.keys() ^ grads_f.keys())[:3]}")
        for n, g in grads_e.items():
            try:
                torch.testing.assert_close(grads_f[n], g, **GRAD_TOL)
            except AssertionError as e:
                return result("mismatch", f"grad {n}: " + " ".join(str(e).split("\n")[1:3]))
    return result("match", f"{calls['fwd']} kernel calls")


class _Timeout(BaseException):  # not caught by run_one's handlers
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    """SIGALRM-based limit (main thread on POSIX only; elsewhere no limit)."""
    import signal
    import threading

    if seconds <= 0 or not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise _Timeout(f"took longer than {seconds}s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def sweep(types=None, backward: bool = True, progress=None, time_limit: int = 30) -> list[Result]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    transformers.logging.set_verbosity_error()
    all_types = text_model_types()
    results = []
    for model_type, skip in all_types.items():
        if types and model_type not in types:
            continue
        if skip:
            res = Result(model_type, "skipped", skip)
        else:
            try:
                with _time_limit(time_limit):
                    res = run_one(model_type, backward)
            except _Timeout as e:
                res = Result(model_type, "untestable", f"tiny model too slow on CPU: {e}")
            except Exception as e:  # the harness itself must never stop the sweep
                res = Result(model_type, "crash", f"harness: {_first_line(e)}\n{traceback.format_exc(limit=2)}")
        results.append(res)
        if progress:
            progress(res)
    return results


def counts(results) -> dict[str, int]:
    return {c: sum(r.status == c for r in results) for c in CLASSES}


def format_table(results, markdown: bool = False) -> str:
    lines = []
    if markdown:
        lines += ["| model type | result | detail |", "|---|---|---|"]
        lines += [f"| `{r.model_type}` | {r.status} | {r.detail.replace('|', '/')} |" for r in results]
    else:
        width = max([len(r.model_type) for r in results] + [10])
        lines += [f"{r.model_type:<{width}}  {r.status:<12}  {r.detail}" for r in results]
    c = counts(results)
    lines.append("")
    lines.append(", ".join(f"{k}: {v}" for k, v in c.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hf_flash coverage", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown table (for the README)")
    parser.add_argument("--only", nargs="+", metavar="TYPE", help="run only these model types")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("-v", "--verbose", action="store_true", help="print each result as it comes")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))

    def progress(r):
        if args.verbose:
            print(f"{r.model_type:<32} {r.status:<12} {r.seconds:5.2f}s  {r.detail}", file=sys.stderr, flush=True)

    results = sweep(args.only, backward=not args.no_backward, progress=progress)
    print(format_table(results, markdown=args.markdown))
    return 1 if any(r.status in FAIL_CLASSES for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
