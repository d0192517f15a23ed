"""Every place that lists the eviction policies lists the built-in ones.

Markdown marks a policy list with HTML comments, each policy in backticks:

    <!-- policies -->
    - `hubchain` (the default): ...
    - `lru`: ...
    <!-- /policies -->

Each marked list names exactly the built-in policies (kvoffload.policies.
BUILT_IN, what the registry starts with); docs/POLICIES.md must hold one.
The examples set built-in policies only; `kvoffload replay --help`,
`kvoffload demo --help` and the CPU spec's docstring name every built-in
one. And the registry imports a policy's module only when it is asked for.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvoffload.tiers.cpu.spec as cpu_spec
from kvoffload.cli import main
from kvoffload.policies import BUILT_IN, DEFAULT_POLICY

ROOT = Path(__file__).resolve().parents[2]
MARKED = re.compile(r"<!-- policies -->(.*?)<!-- /policies -->", re.S)
MUST_LIST = ["README.md", "docs/POLICIES.md"]  # files that must hold a marked list


def markdown_files() -> list[Path]:
    """README.md, docs/ and examples/ (not docs/_incoming: drafts for the lead to merge)."""
    found = {*ROOT.glob("*.md"), *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md")}
    return sorted(p for p in found if "_incoming" not in p.relative_to(ROOT).parts)


def marked_lists(text: str) -> list[set[str]]:
    return [set(re.findall(r"`([a-z0-9_]+)`", block)) for block in MARKED.findall(text)]


@pytest.mark.parametrize("path", MUST_LIST)
def test_the_policy_docs_hold_a_marked_list(path):
    assert marked_lists((ROOT / path).read_text()), f"{path}: no <!-- policies --> list"


def test_every_marked_list_names_exactly_the_built_in_policies():
    seen = 0
    for path in markdown_files():
        text = path.read_text()
        assert text.count("<!-- policies -->") == text.count("<!-- /policies -->"), f"{path}: unclosed list"
        for names in marked_lists(text):
            seen += 1
            assert names == set(BUILT_IN), f"{path.relative_to(ROOT)}: lists {sorted(names)}"
    assert seen >= len(MUST_LIST)


def eviction_policies(node) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "eviction_policy"] + \
            [p for v in node.values() for p in eviction_policies(v)]
    if isinstance(node, list):
        return [p for v in node for p in eviction_policies(v)]
    return []


def test_the_examples_set_built_in_policies():
    found = []
    for path in sorted(ROOT.glob("examples/**/*.json")):
        for name in eviction_policies(json.loads(path.read_text())):
            found.append(name)
            assert name in BUILT_IN, f"{path.relative_to(ROOT)}: eviction_policy {name!r}"
    assert DEFAULT_POLICY in found  # the CPU example shows the default


@pytest.mark.parametrize("command", ["replay", "demo"])
def test_help_names_every_built_in_policy(command):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([command, "--help"])
    section = re.search(r"\n  --policy POLICY(.*?)\n  --", out.getvalue(), re.S).group(1)
    words = set(re.findall(r"[a-z0-9_]+", section))
    assert set(BUILT_IN) <= words
    assert f"{DEFAULT_POLICY} (default)" in " ".join(section.split())


def test_the_cpu_spec_docstring_names_exactly_the_built_in_policies():
    line = next(ln for ln in cpu_spec.__doc__.splitlines() if ln.strip().startswith("eviction_policy"))
    assert set(re.findall(r'"([a-z0-9_]+)"', line)) == set(BUILT_IN)
    assert f'"{DEFAULT_POLICY}" (default)' in line


def test_the_registry_imports_a_policy_on_first_use():
    code = ("import sys, kvoffload.policies as p\n"
            "before = sorted(m for m in sys.modules if m.startswith('kvoffload.policies.'))\n"
            "p.get_policy_class('hubchain')\n"
            "print(before, 'kvoffload.policies.hubchain.policy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['kvoffload.policies.base'] True"
