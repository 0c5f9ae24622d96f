import argparse
import sys

from . import decode, e2e, generate, kernels, overhead


COMMANDS = {"kernels": kernels, "overhead": overhead, "decode": decode, "e2e": e2e, "generate": generate}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hf_flash.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"kernels": (kernels, "attention kernels: hf_flash vs FlashAttention-4, cuDNN and SDPA-flash"),
                "overhead": (overhead, "host µs per attention call: hf_flash vs SDPA and FlashAttention-4"),
                "decode": (decode, "decode attention against a KV cache: GB/s of hf_flash vs the SDPA backends"),
                "e2e": (e2e, "whole-model training and generation: hf_flash vs sdpa, flash_attention_4, "
                               "flex_attention, eager"),
                "generate": (generate, "generate() tokens/s, dynamic and static (compiled) caches: hf_flash vs "
                                       "sdpa and each SDPA backend, eager, flex_attention")}
    for name, (module, help_text) in commands.items():
        module.add_arguments(sub.add_parser(name, help=help_text))
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    COMMANDS[args.command].run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
