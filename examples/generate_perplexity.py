"""Perplexity with hf_flash next to a reference backend, then generation.

    python examples/generate_perplexity.py --model HuggingFaceTB/SmolLM2-135M --text-file text.txt
    python examples/generate_perplexity.py --model /path/to/folder --gguf-file model.Q4_1.gguf \
        --text-file .data/tinyshakespeare.txt --prompt "ROMEO:"

The model is loaded once; the attention backend is switched in place with
`set_attn_implementation`, so both perplexities use identical weights. Text is
scored in windows of --window tokens with a stride (each token scored once,
with up to window - stride tokens of context). Exits 1 if the perplexities
differ by more than --tolerance (relative).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_flash  # noqa: F401  (registers attn_implementation="hf_flash")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hub name or local folder")
    p.add_argument("--gguf-file", help="GGUF file inside --model's folder")
    p.add_argument("--text-file", required=True)
    p.add_argument("--max-tokens", type=int, default=4096, help="score at most this many tokens of the text")
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--stride", type=int, default=512)
    p.add_argument("--reference", default="sdpa", help="backend to compare with (sdpa, eager, flex_attention)")
    p.add_argument("--tolerance", type=float, default=None, help="relative (default 1e-4 fp32, 1e-2 bf16/fp16)")
    p.add_argument("--prompt", action="append", default=None, help="prompt to generate from (repeatable)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto")
    return p.parse_args(argv)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, window: int, stride: int) -> float:
    """Strided sliding-window perplexity of a 1-D token tensor."""
    nll, counted, prev_end = 0.0, 0, 0
    for start in range(0, len(ids), stride):
        end = min(start + window, len(ids))
        chunk = ids[start:end][None].to(model.device)
        labels = chunk.clone()
        labels[:, : prev_end - start] = -100  # score only tokens not scored before
        scored = int((labels[:, 1:] != -100).sum())
        if scored:
            nll += model(input_ids=chunk, labels=labels).loss.float().item() * scored
            counted += scored
        prev_end = end
        if end == len(ids):
            break
    return math.exp(nll / counted)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"auto": torch.bfloat16 if device == "cuda" else torch.float32, "float32": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    tolerance = args.tolerance or (1e-4 if dtype == torch.float32 else 1e-2)
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="hf_flash", dtype=dtype,
                                                 **kwargs).to(device).eval()
    text = open(args.text_file, encoding="utf-8").read()
    ids = tokenizer(text, return_tensors="pt").input_ids[0][: args.max_tokens]

    results = {}
    for backend in ("hf_flash", args.reference):
        model.set_attn_implementation(backend)
        start = time.perf_counter()
        results[backend] = perplexity(model, ids, args.window, args.stride)
        print(f"{backend:>16}: perplexity {results[backend]:.4f} over {len(ids)} tokens "
              f"({time.perf_counter() - start:.1f}s)")
    rel = abs(results["hf_flash"] - results[args.reference]) / results[args.reference]
    ok = rel <= tolerance
    print(f"relative difference {rel:.2e} (tolerance {tolerance:.0e}, {dtype}): {'PASS' if ok else 'FAIL'}")

    model.set_attn_implementation("hf_flash")
    prompts = args.prompt or [text[:200]]
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to(device)
    out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tokenizer.pad_token_id)
    for prompt, row in zip(prompts, out[:, batch.input_ids.shape[1]:]):
        print(f"--- {prompt!r}\n{tokenizer.decode(row, skip_special_tokens=True)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
