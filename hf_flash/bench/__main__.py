import argparse
import sys

from . import kernels


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hf_flash.bench")
    sub = parser.add_subparsers(dest="command", required=True)
    kernels.add_arguments(sub.add_parser("kernels", help="attention kernels: hf_flash vs the SDPA backends"))
    args = parser.parse_args(argv)
    if args.command == "kernels":
        kernels.run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
