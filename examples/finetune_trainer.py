"""Fine-tune a causal LM with transformers' Trainer on hf_flash attention.

    python examples/finetune_trainer.py --model HuggingFaceTB/SmolLM2-135M --dataset wikitext \
        --dataset-config wikitext-2-raw-v1 --packing
    python examples/finetune_trainer.py --text-file .data/tinyshakespeare.txt --max-steps 50
    accelerate launch --num_processes 2 examples/finetune_trainer.py --text-file data.txt   # several GPUs

Without --model it trains a small random-init Llama on bytes (no download).
Data comes through `datasets`: a Hub dataset (--dataset) or a local text file
(--text-file), cut into examples of varying length, then either packed
(`DataCollatorWithFlattening`: one row, no padding, sequence boundaries as
position ids and as flash-attention `cu_seq_lens`, computed on the CPU so the
attention layers need no host sync) or padded. Logs loss, tokens/s and peak GPU memory; --lora
trains LoRA adapters with PEFT.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, LlamaConfig, Trainer,
                          TrainerCallback, TrainingArguments)

import hf_flash  # noqa: F401  (registers attn_implementation="hf_flash")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Hub name or local path (default: random-init small Llama on bytes)")
    p.add_argument("--gguf-file", help="GGUF file inside --model's folder")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--dataset", help="Hub dataset name with a 'text' column")
    src.add_argument("--text-file", help="local text file, one document per blank-line-separated block")
    p.add_argument("--dataset-config")
    p.add_argument("--attn", default="hf_flash", help="attn_implementation (compare with sdpa, eager, ...)")
    p.add_argument("--packing", action="store_true", help="pack with DataCollatorWithFlattening instead of padding")
    p.add_argument("--max-length", type=int, default=512, help="longest example, in tokens")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--weights", choices=["bfloat16", "float32"], default="bfloat16",
                   help="weight dtype on GPU; float32 keeps fp32 master weights under bf16 autocast (CPU: float32)")
    p.add_argument("--lora", action="store_true", help="train LoRA adapters (needs peft)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--logging-steps", type=int, default=None, help="default: max_steps / 20")
    p.add_argument("--output-dir", default="out/finetune")
    p.add_argument("--loss-log", help="write the per-step training losses here (JSON), e.g. to compare runs")
    return p.parse_args(argv)


class ByteTokenizer:
    """Bytes as tokens: lets the random-init default run with no download."""

    vocab_size, pad_token_id = 257, 256

    def __call__(self, texts):
        return {"input_ids": [list(t.encode("utf-8")) for t in texts]}


def load_model_and_tokenizer(args, dtype):
    if args.model is None:
        config = LlamaConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=256, intermediate_size=768,
                             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                             max_position_embeddings=max(2048, args.max_length), pad_token_id=ByteTokenizer.pad_token_id)
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation=args.attn, dtype=dtype), ByteTokenizer()
    kwargs = {"gguf_file": args.gguf_file} if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.model, **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=args.attn, dtype=dtype, **kwargs)
    return model, tokenizer


def load_examples(args, tokenizer):
    from datasets import load_dataset

    if args.text_file:
        raw = load_dataset("text", data_files=args.text_file, sample_by="paragraph", split="train")
    else:
        raw = load_dataset(args.dataset, args.dataset_config, split="train")
    raw = raw.filter(lambda x: len(x["text"].strip()) > 0)

    def tokenize(batch):
        ids = [x[: args.max_length] for x in tokenizer(batch["text"])["input_ids"]]
        return {"input_ids": ids}

    return raw.map(tokenize, batched=True, remove_columns=raw.column_names).filter(lambda x: len(x["input_ids"]) > 1)


def pad_collator(pad_id):
    def collate(batch):
        width = max(len(x["input_ids"]) for x in batch)
        ids = torch.full((len(batch), width), pad_id)
        mask = torch.zeros_like(ids)
        for row, x in enumerate(batch):
            ids[row, : len(x["input_ids"])] = torch.tensor(x["input_ids"])
            mask[row, : len(x["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    return collate


class Throughput(TrainerCallback):
    """Adds tokens/s (non-padding tokens) and peak GPU memory to the logs."""

    def __init__(self):
        self.tokens, self.start = 0, None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = self.start or time.perf_counter()

    def count(self, batch):
        mask = batch.get("attention_mask")
        self.tokens += int(mask.sum()) if mask is not None else batch["input_ids"].numel()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self.start is not None:
            # Every process sees an equal share of each global batch (data parallel): scale by world size.
            logs["tokens_per_s"] = round(self.tokens * args.world_size / (time.perf_counter() - self.start))
            if torch.cuda.is_available():
                logs["peak_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)


def per_step_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main(argv=None):
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    model, tokenizer = load_model_and_tokenizer(args, getattr(torch, args.weights) if on_gpu else torch.float32)
    if args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
                                                 task_type="CAUSAL_LM"))
        model.print_trainable_parameters()
    examples = load_examples(args, tokenizer)
    throughput = Throughput()
    if args.packing:
        base = DataCollatorWithFlattening(return_flash_attn_kwargs=True)
    else:
        base = pad_collator(tokenizer.pad_token_id)

    def collate(batch):
        out = base(batch)
        throughput.count(out)
        return out

    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=args.max_steps // 10, logging_steps=args.logging_steps or max(1, args.max_steps // 20),
        save_strategy="no", report_to=[], seed=args.seed, bf16=on_gpu,
        use_cpu=not on_gpu, dataloader_num_workers=0, remove_unused_columns=False,
        ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=training_args, train_dataset=examples, data_collator=collate,
                      callbacks=[throughput])
    result = trainer.train()
    if trainer.is_world_process_zero():
        if args.loss_log:
            with open(args.loss_log, "w") as f:
                json.dump(per_step_losses(trainer), f)
        tokens_per_s = throughput.tokens * training_args.world_size / (time.perf_counter() - throughput.start)
        print(f"attn={args.attn} packing={args.packing} processes={training_args.world_size} "
              f"parallel={trainer.accelerator.distributed_type.value} "
              f"final loss {result.training_loss:.4f} tokens/s {tokens_per_s:.0f}")
    return trainer


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # a process group left to interpreter teardown can abort there (gloo)
        torch.distributed.destroy_process_group()
