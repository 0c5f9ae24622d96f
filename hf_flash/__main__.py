"""Command line: ``python -m hf_flash {env,build,coverage,demo}`` (and ``python -m hf_flash.bench``)."""

from __future__ import annotations

import sys

USAGE = """usage: python -m hf_flash COMMAND [options]

commands:
  env    versions, GPU, and which attention path runs (and why)
  build  build the CUDA kernels now (else done on first use; HF_FLASH_CUDA_ARCHS="80;90a" builds without a GPU)
  coverage  run every transformers text model type on hf_flash vs eager (--markdown, --only TYPE...)
  demo   fine-tune a small Llama with Trainer on hf_flash, generate, compare perplexity with sdpa
"""


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "env":
        import hf_flash

        print(hf_flash.env_report())
        return 0
    if command == "build":
        from hf_flash._build import build_main

        return build_main(rest)
    if command == "coverage":
        from hf_flash.coverage import main as coverage

        return coverage(rest)
    if command == "demo":
        from hf_flash.demo import main as demo

        return demo(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
