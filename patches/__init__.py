"""Per-model patches for transformers models that bypass the attention interface.

Installed as ``hf_flash.patches``. Most transformers text models call the
function registered for ``config._attn_implementation`` and run on hf_flash
as is. Older families compute attention themselves: some fail at load with a
``KeyError`` (gpt_neo, gptj, falcon), some crash on our padding mask, some
silently run eager math; a few call the interface but rely on eager's 4-D
mask for something flash attention takes elsewhere (nllb-moe's causality and
router padding, t5gemma's bidirectional window). Each module here fixes one
family so it runs on hf_flash kernels; ``MODEL_TYPE_TO_PATCH`` maps
``config.model_type`` to its ``apply_hf_flash_to_<module>(model=None)``
function (Liger's pattern). A patch applies only while the code it replaces
is in the loaded transformers (each module's ``applies()`` checks what the
transformers module defines, never its version); otherwise it steps aside
and the model is checked like any other: transformers moves families onto
the attention interface (codegen and gptj in 5.24), where they run unpatched.

What a model's attention needs that hf_flash cannot carry is read from its
code and config at load: keyword arguments its attention call passes beyond
``hf_flash.integration.CARRIED_ATTENTION_KWARGS`` (score terms such as
``sinks=``, ``position_bias=``), head dims above the kernels'
maximum, attention computed outside the interface. ``REFUSED`` keeps only
what the code does not show (custom 4-D masks, a drafter's shared cache).

When it happens:

* ``from_pretrained`` / ``from_config`` / ``Model(config)`` with
  ``attn_implementation="hf_flash"``: :func:`install` hooks transformers'
  attention check (prepares the class tables before the modules are built,
  and refuses unsupported types) and ``post_init`` (binds the patch on the
  built modules);
* ``hf_flash.patch(model)`` on a built model (any implementation, PEFT
  wrappers included) switches it to hf_flash and binds the patches;
* ``model.set_attn_implementation("hf_flash")`` goes through the same check.

Anything else that would not run on hf_flash raises
:class:`UnsupportedModelError` at load, naming the model type and the
supported families: never a crash mid-forward, never silent eager math.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
import sys
from typing import Callable, Optional

from ._common import NAME, uses_hf_flash

# model_type -> patch module in this package; each defines apply_hf_flash_to_<module>(model=None)
PATCH_MODULES = {
    "bloom": "bloom",
    "codegen": "codegen",
    "falcon": "falcon",
    "gpt_neo": "gpt_neo",
    "gpt_neox_japanese": "gpt_neox_japanese",
    "gptj": "gptj",
    "layoutlm": "extended_mask",
    "longt5": "t5",
    "markuplm": "extended_mask",
    "mpt": "mpt",
    "mt5": "t5",
    "nllb-moe": "nllb_moe",
    "pop2piano": "t5",
    "roformer": "roformer",
    "switch_transformers": "t5",
    "t5": "t5",
    "t5gemma": "t5gemma",
    "umt5": "t5",
    "xglm": "xglm",
}

# What the score terms that models pass to the attention function add (for refusal messages only: whether
# hf_flash carries one is hf_flash.integration.CARRIED_ATTENTION_KWARGS).
SCORE_TERMS = {
    "s_aux": "learned attention sinks",
    "sinks": "per-token attention sinks",
    "position_bias": "a learned relative position bias",
    "indices": "a sparse-attention indexer's per-query top-k key selection",
    "block_indices": "a block-sparse key selection",
}

# Types whose needs their code and config do not show (they pass nothing unusual to the attention function),
# with the reason; and families that compute attention in their own code (refused without an entry too), where
# the entry says why no patch carries them. Everything detectable is detected in check_supported, for any type.
_MASK = "it builds custom 4-D attention masks that flash attention cannot express"
_DSA = ("its sparse-attention indexer (DeepSeek Sparse Attention, Qwen QSA) folds a per-query top-k key selection "
        "into a 4-D attention mask (and indexes that mask directly), which flash attention cannot express")
_DISENTANGLED = ("its disentangled attention adds content-to-position and position-to-content terms "
                 "(query . relative-position key, key . relative-position query) to the scores, which flash "
                 "attention cannot carry")
_GLOBAL_LOCAL = ("its attention mixes a sliding window with global tokens that attend and are attended "
                 "everywhere (chunked in its own code), which one flash attention call cannot express")
_DRAFTER = ("it is a speculative-decoding drafter: every layer reads the target model's shared key/value cache "
            "(num_kv_shared_layers = num_hidden_layers), which hf_flash does not read yet")
_ZERO_PAD = ("with a padded batch, flash attention leaves the padded positions' outputs at zero; where the pad "
             "token's embedding rows are zero too (nn.Embedding padding_idx, as in a freshly initialised model) "
             "their hidden states stay exactly zero, and its AltUp magnitude (mean square ** 0.5, no epsilon) has an "
             "infinite derivative there, so parameter gradients become NaN (eager gives padded positions non-zero "
             "outputs; logits on real tokens match, and so do gradients when the pad rows are non-zero)")
REFUSED: dict[str, str] = {
    "pegasus_x": ("its encoder runs block-local attention with global tokens in its own code "
                  "(PegasusXGlobalLocalAttention: a block's queries see the global tokens and their own block), not "
                  "through transformers' attention interface, and hf_flash has no patch for it yet"),
    "bigbird_pegasus": ("its encoder computes attention in its own code (BigBirdPegasusSelfAttention, or block-sparse "
                        "attention over random key blocks), not through transformers' attention interface; only "
                        "the decoder would run on hf_flash"),
    "qwen4_exp_text": _DSA,
    "gemma4_assistant": _DRAFTER, "gemma4_unified_assistant": _DRAFTER,
    "gemma3n_text": _ZERO_PAD,
    "doge": _MASK,
    # encoders that compute attention in their own code, with score terms flash attention cannot carry
    "deberta": _DISENTANGLED, "deberta-v2": _DISENTANGLED,
    "xlnet": ("its two-stream relative attention adds position (query . relative key) and segment terms to the "
              "scores, which flash attention cannot carry"),
    "longformer": _GLOBAL_LOCAL, "led": _GLOBAL_LOCAL,
    "big_bird": ("its default block-sparse attention attends to random key blocks (plus global and window "
                 "blocks), a pattern flash attention cannot express"),
}


class UnsupportedModelError(ValueError):
    """This model type cannot run on hf_flash (raised at load, never mid-forward)."""


def patch_function(model_type: str) -> Callable:
    """The ``apply_hf_flash_to_<module>`` function for a type in the table."""
    module = importlib.import_module(f"{__name__}.{PATCH_MODULES[model_type]}")
    return getattr(module, f"apply_hf_flash_to_{PATCH_MODULES[model_type]}")


class _LazyTable(dict):
    """``MODEL_TYPE_TO_PATCH[type]`` imports the patch module on first use."""

    def __missing__(self, key):
        if key not in PATCH_MODULES:
            raise KeyError(key)
        self[key] = fn = patch_function(key)
        return fn

    def __contains__(self, key):
        return key in PATCH_MODULES

    def __iter__(self):
        return iter(PATCH_MODULES)

    def __len__(self):
        return len(PATCH_MODULES)

    def keys(self):
        return PATCH_MODULES.keys()

    def items(self):
        return [(k, self[k]) for k in PATCH_MODULES]

    def values(self):
        return [self[k] for k in PATCH_MODULES]


MODEL_TYPE_TO_PATCH: dict[str, Callable] = _LazyTable()


def patch_applies(model_type: str) -> bool:
    """True if ``model_type`` has a patch and the code it replaces is in the loaded transformers."""
    if model_type not in PATCH_MODULES:
        return False
    return importlib.import_module(f"{__name__}.{PATCH_MODULES[model_type]}").applies()


def supported_summary() -> str:
    return ("hf_flash runs every transformers model that routes attention through its attention interface, "
            f"plus these patched families: {', '.join(sorted(PATCH_MODULES))}")


@functools.lru_cache(maxsize=None)
def _module_routes_attention(module_name: str) -> Optional[bool]:
    """True if the modeling module calls the attention interface, False if it defines its own
    attention modules without it, None if it defines no attention module (a wrapper or attention-free)."""
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except OSError:
        return None
    if "ALL_ATTENTION_FUNCTIONS" in source:
        return True
    if re.search(r"^class \w*(Attention|Attn)\w*\(nn\.Module\)", source, re.M):
        return False
    return None


@functools.lru_cache(maxsize=None)
def attention_call_kwargs(module_name: str) -> frozenset:
    """Keyword names the modeling module passes, by name, to the attention function it looks up in
    ``ALL_ATTENTION_FUNCTIONS`` (``attention_interface(self, q, k, v, mask, scaling=..., sinks=...)``)."""
    path = getattr(sys.modules.get(module_name), "__file__", None)
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, TypeError):
        return frozenset()
    looked_up = set()  # names the looked-up function is bound to
    for node in ast.walk(tree):
        value = getattr(node, "value", None)
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and value is not None \
                and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(value):
            looked_up.update(ast.unparse(t) for t in getattr(node, "targets", [getattr(node, "target", None)]))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and (ast.unparse(node.func) in looked_up
                                           or isinstance(node.func, ast.Subscript)
                                           and "ALL_ATTENTION_FUNCTIONS" in ast.unparse(node.func)):
            names.update(k.arg for k in node.keywords if k.arg is not None)  # None: **kwargs
    return frozenset(names)


def _head_dims(config) -> dict:
    """{description: value} of the attention head dims a config asks for (its text config's and per-layer
    configs' too), read as transformers reads them: ``head_dim``, else ``hidden_size // num_attention_heads``."""
    dims = {}
    for c in _configs(config):
        for attr in ("head_dim", "global_head_dim", "v_head_dim"):
            if isinstance(_get(c, attr), int):
                dims[f"config.{attr}"] = _get(c, attr)
        hidden, heads = _get(c, "hidden_size"), _get(c, "num_attention_heads")
        if _get(c, "head_dim") is None and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            dims["config.hidden_size // config.num_attention_heads"] = hidden // heads
        nope, rope = _get(c, "qk_nope_head_dim"), _get(c, "qk_rope_head_dim")
        if isinstance(nope, int) and isinstance(rope, int):  # multi-head latent attention's query/key dim
            dims["config.qk_nope_head_dim + config.qk_rope_head_dim"] = nope + rope
    return dims


def _get(config, attr):
    try:
        return getattr(config, attr, None)
    except Exception:  # a per-layer attribute (gemma4) raises on global access: read per layer instead
        return None


def _configs(config) -> list:
    """The config, its text config and their per-layer configs (gemma4's ``per_layer_config``)."""
    try:
        text = config.get_text_config()
    except Exception:
        text = None
    found = [config] + ([text] if text is not None and text is not config else [])
    for c in list(found):
        layers = _get(c, "per_layer_config")
        try:
            found += list(layers.values() if isinstance(layers, dict) else layers or ())
        except Exception:  # a view over layers that this config does not define
            pass
    return found


def allow_hf_flash_in_flash_list(model_cls) -> None:
    """A model class that pins its flash kernels (``_compatible_flash_implementations``) keeps "hf_flash".

    transformers rewrites any other "flash" name to the first entry of that list (a hub kernel, which
    needs the ``kernels`` package); with ours in the list, the model runs on hf_flash or refuses here.
    """
    names = getattr(model_cls, "_compatible_flash_implementations", None)
    if isinstance(names, (list, tuple)) and NAME not in names:
        model_cls._compatible_flash_implementations = [*names, NAME]


def _refusal(model_type: str, why: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"model type {model_type!r} cannot run on attn_implementation='hf_flash': {why}. "
        f"{supported_summary()}. Load it with attn_implementation='eager' or 'sdpa'.")


def check_supported(model_cls, config) -> None:
    """Raise :class:`UnsupportedModelError` unless ``model_cls`` with ``config`` runs on hf_flash."""
    model_type = getattr(config, "model_type", None) or "<unknown>"
    from hf_flash.integration import CARRIED_ATTENTION_KWARGS
    from hf_flash.interface import MAX_HEAD_DIM

    if patch_applies(model_type):
        module = importlib.import_module(f"{__name__}.{PATCH_MODULES[model_type]}")
        reason = getattr(module, "unsupported", lambda c: None)(config)
        if reason:
            raise _refusal(model_type, reason)
        return
    if model_type in REFUSED:
        raise _refusal(model_type, REFUSED[model_type])
    extra = sorted(attention_call_kwargs(model_cls.__module__) - CARRIED_ATTENTION_KWARGS)
    if extra:
        terms = ", ".join(f"{name}= ({SCORE_TERMS[name]})" if name in SCORE_TERMS else f"{name}=" for name in extra)
        raise _refusal(model_type, f"its attention call passes {terms} to the attention function, which hf_flash "
                                   "does not carry (transformers' flash path would drop it)")
    for what, value in _head_dims(config).items():
        if value > MAX_HEAD_DIM:
            raise _refusal(model_type, f"{what} = {value} is above hf_flash's maximum head dim {MAX_HEAD_DIM}")
    if _module_routes_attention(model_cls.__module__) is False:
        raise _refusal(model_type, f"{model_cls.__name__} computes attention itself (it does not call "
                                   "transformers' attention interface) and hf_flash has no patch for it yet")


def _attention_module_count(model) -> int:
    pattern = re.compile(r"(Attention|Attn)$|SelfAttention|MultiHeadAttention")
    return sum(1 for m in model.modules() if pattern.search(type(m).__name__))


def _apply(model, model_type: str) -> None:
    MODEL_TYPE_TO_PATCH[model_type](model=model)


def _pretrained_models(model):
    """Every transformers PreTrainedModel inside ``model`` (PEFT wrappers, composite models)."""
    from transformers import PreTrainedModel

    return [m for m in model.modules() if isinstance(m, PreTrainedModel)]


def patch(model):
    """Switch an already-built model (PEFT-wrapped included) to hf_flash, in place; returns it.

    Refuses (:class:`UnsupportedModelError`) before changing anything if a model inside
    cannot run on hf_flash.
    """
    inner = _pretrained_models(model)
    if not inner:
        raise TypeError(f"hf_flash.patch expects a transformers model (or a wrapper of one), got "
                        f"{type(model).__name__}")
    for m in inner:
        check_supported(type(m), m.config)
    for m in inner:
        m.config._attn_implementation = NAME
    seen = set()
    for m in inner:
        model_type = m.config.model_type
        if patch_applies(model_type) and id(m.config) not in seen:
            seen.add(id(m.config))
            _apply(m, model_type)
    return model


_HOOKED = "_hf_flash_hooked"


def _fix_target_dtype_for_conv1d() -> None:
    """transformers' flash wrapper finds the model dtype from the first ``nn.Linear`` of an attention
    module when the query is fp32; GPT-2-style modules (``Conv1D``) have none and it raises StopIteration.
    Fall back to the module's first floating parameter (the wrapper's own result in every other case)."""
    from transformers.integrations import flash_attention as fa

    original = fa.get_target_dtype
    if getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def get_target_dtype(query, module):
        try:
            return original(query, module)
        except StopIteration:
            return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)

    setattr(get_target_dtype, _HOOKED, True)
    fa.get_target_dtype = get_target_dtype


def install() -> None:
    """Hook transformers so that loading with hf_flash prepares, patches or refuses (idempotent)."""
    from transformers import PreTrainedModel

    check = PreTrainedModel._check_and_adjust_attn_implementation
    if not getattr(check, _HOOKED, False):
        @functools.wraps(check)
        def _check_and_adjust_attn_implementation(self, attn_implementation, *args, **kwargs):
            if isinstance(attn_implementation, str) and attn_implementation.removeprefix("paged|") == NAME:
                check_supported(type(self), self.config)
                allow_hf_flash_in_flash_list(type(self))
                model_type = getattr(self.config, "model_type", None)
                if patch_applies(model_type):
                    MODEL_TYPE_TO_PATCH[model_type]()  # class tables, before the modules are built
                    if any(True for _ in self.children()):  # set_attn_implementation on a built model
                        _apply(self, model_type)
            return check(self, attn_implementation, *args, **kwargs)

        setattr(_check_and_adjust_attn_implementation, _HOOKED, True)
        PreTrainedModel._check_and_adjust_attn_implementation = _check_and_adjust_attn_implementation

    _fix_target_dtype_for_conv1d()
    post_init = PreTrainedModel.post_init
    if not getattr(post_init, _HOOKED, False):
        @functools.wraps(post_init)
        def _post_init(self, *args, **kwargs):
            out = post_init(self, *args, **kwargs)
            config = getattr(self, "config", None)
            if config is not None and uses_hf_flash(config):
                model_type = getattr(config, "model_type", None)
                if patch_applies(model_type):
                    _apply(self, model_type)
                elif _attention_module_count(self) == 0 and _module_routes_attention(type(self).__module__) is None:
                    raise _refusal(model_type, f"{type(self).__name__} has no attention layers for hf_flash to run")
            return out

        setattr(_post_init, _HOOKED, True)
        PreTrainedModel.post_init = _post_init


__all__ = ["MODEL_TYPE_TO_PATCH", "PATCH_MODULES", "REFUSED", "SCORE_TERMS", "UnsupportedModelError", "attention_call_kwargs",
           "check_supported", "install", "patch_applies",
           "patch", "patch_function", "supported_summary"]
