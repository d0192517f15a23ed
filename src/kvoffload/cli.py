"""The `kvoffload` command. Each subcommand lives beside the code it runs and
registers itself through an `add_parser(subparsers)` function, so this file
only lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module defining add_parser(subparsers); the parser it adds
# sets `func` (args -> exit code).
COMMANDS = {
    "replay": "kvoffload.replay.cli",
    "demo": "kvoffload.demo",
    "stats": "kvoffload.stats",
    "storage": "kvoffload.tiers.storage.check",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvoffload", description="KV-cache offloading engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in COMMANDS.items():
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as e:  # a subcommand whose extra is missing
            p = sub.add_parser(name, help=f"(unavailable: {e})")
            p.set_defaults(func=lambda args, e=e: sys.exit(f"kvoffload: {e}"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
