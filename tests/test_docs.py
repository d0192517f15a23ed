"""The docs against the code and against their own limits: the configuration
tables and the replay's flags list exactly what the code accepts, the configs
the docs show use only documented keys, the architecture map names files that
exist and its Python example runs, every relative link points at a file (and
heading), README and BENCHMARKS stay short, and BENCHMARKS holds no dated
headings or machine paths. A failure names the file, the table and the key."""

from __future__ import annotations

import ast
import json
import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from kvoffload.config import ConfigError, OffloadingConfig
from kvoffload.spec import build_spec

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
CONFIGURATION = DOCS / "CONFIGURATION.md"
REPLAY = DOCS / "REPLAY.md"
BENCHMARKS = DOCS / "BENCHMARKS.md"
EXAMPLES = ROOT / "examples" / "vllm"


# ---- tables marked `<!-- keys: NAME -->` / `<!-- flags: NAME -->` ---------------------------

def marked_tables(path: Path, kind: str) -> dict[str, list[str]]:
    """NAME -> the backticked names in the first column of the table that
    follows each `<!-- KIND: NAME -->` marker (several tables may share a NAME)."""
    tables: dict[str, list[str]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    marker = re.compile(rf"<!--\s*{kind}:\s*([\w./-]+)\s*-->")
    for i, line in enumerate(lines):
        m = marker.search(line)
        if not m:
            continue
        names = tables.setdefault(m.group(1), [])
        rows = []
        for row in lines[i + 1:]:
            if not row.startswith("|"):
                if rows:
                    break
                continue
            rows.append(row)
        for row in rows[2:]:  # after the header and its separator
            first = row.split("|")[1]
            names.extend(re.findall(r"`([^`]+)`", first))
    return tables


def known_keys(build) -> set[str]:
    """The keys the code accepts where it checks them: an unknown key's
    ConfigError lists them ("...; known keys: [...]")."""
    with pytest.raises(ConfigError) as e:
        build("zz_not_a_key")
    message = str(e.value)
    assert "known keys: " in message, message
    return set(ast.literal_eval(message.split("known keys: ", 1)[1]))


def tiered_config(extra: dict) -> OffloadingConfig:
    # kv_bytes_per_chunk: the tiers are built (and their keys checked) at construction
    return OffloadingConfig.from_dict({"extra_config": {"num_cpu_chunks": 4, "kv_bytes_per_chunk": 4096, **extra}})


def tier_keys(tier_type: str) -> set[str]:
    keys = known_keys(lambda k: build_spec("tiered", tiered_config(
        {"secondary_tiers": [{"type": tier_type, k: 1}]})))
    if tier_type == "mooncake":
        keys.add("url")  # MooncakeConfig.from_dict takes mooncake://HOST:PORT apart before the check
    return keys


def cpu_keys() -> set[str]:
    return known_keys(lambda k: build_spec("cpu", OffloadingConfig.from_dict({"extra_config": {k: 1}})))


def code_tables() -> dict[str, set[str]]:
    from kvoffload import hints
    from kvoffload.integrations.sglang.config import BackendConfig
    from kvoffload.tiering import TIER_KEYS

    sglang = {f.name for f in fields(BackendConfig)} - {"tier_type", "tier_config"} | {"type"}
    tables = {
        "config": known_keys(lambda k: OffloadingConfig.from_dict({k: 1})),
        "config.groups": known_keys(lambda k: OffloadingConfig.from_dict({"groups": [{"tokens_per_block": 16, k: 1}]})),
        "cpu": cpu_keys(),
        "tiered": known_keys(lambda k: build_spec("tiered", tiered_config({k: 1}))) - cpu_keys(),
        "namespace": known_keys(lambda k: build_spec("tiered", tiered_config({"namespace": {k: "x"}}))),
        "secondary_tiers": set(TIER_KEYS),
        "storage": tier_keys("storage"),
        "redis": tier_keys("redis"),
        "mooncake": tier_keys("mooncake"),
        "sglang": sglang,
        "request": {hints.RETENTION, hints.LOAD_TIERS},
    }
    if vllm_importable():
        from kvoffload import metrics_vllm
        from kvoffload.integrations.vllm.convert import SPEC_KEY, VLLM_OWNED_KEYS

        tables["vllm"] = set(VLLM_OWNED_KEYS) | {SPEC_KEY, metrics_vllm.OPTION}
    return tables


def vllm_importable() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") == "1":  # CI sets it: a missing vLLM fails there
            raise
        return False
    return True


def drift(doc: str, documented: dict[str, list[str]], code: dict[str, set[str]], what: str) -> list[str]:
    problems = []
    for name in sorted(code.keys() - documented.keys()):
        problems.append(f"{doc}: no table marked <!-- {what}: {name} --> (the code accepts {sorted(code[name])})")
    for name in sorted(documented.keys() & code.keys()):
        listed = documented[name]
        for key in sorted(code[name] - set(listed)):
            problems.append(f"{doc}, table '{name}': missing key {key!r}, which the code accepts: add a row")
        for key in sorted(set(listed) - code[name]):
            problems.append(f"{doc}, table '{name}': lists {key!r}, which the code refuses: remove the row")
        for key in sorted({k for k in listed if listed.count(k) > 1}):
            problems.append(f"{doc}, table '{name}': lists {key!r} twice")
    return problems


def test_configuration_lists_every_key_the_code_accepts_and_no_other():
    documented = marked_tables(CONFIGURATION, "keys")
    code = code_tables()
    problems = drift("docs/CONFIGURATION.md", documented, code, "keys")
    # a marked table the code has no key table for would never be checked
    problems += [f"docs/CONFIGURATION.md: table '{n}' matches no key table of the code (tests/test_docs.py)"
                 for n in sorted(documented.keys() - code.keys()) if n != "vllm"]
    assert not problems, "\n".join(problems)


def test_the_drift_check_names_the_key_and_the_table():
    found = drift("D.md", {"cpu": ["a", "b", "b"]}, {"cpu": {"a", "c"}, "redis": {"u"}}, "keys")
    assert "D.md, table 'cpu': missing key 'c', which the code accepts: add a row" in found
    assert "D.md, table 'cpu': lists 'b', which the code refuses: remove the row" in found
    assert "D.md, table 'cpu': lists 'b' twice" in found
    assert "D.md: no table marked <!-- keys: redis --> (the code accepts ['u'])" in found


def replay_flags() -> set[str]:
    import argparse

    from kvoffload.cli import build_parser

    parser = build_parser(["replay"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices["replay"]._actions for s in a.option_strings
            if s.startswith("--") and s != "--help"}


def test_replay_doc_lists_every_flag_and_no_other():
    documented = {name: [f for k in keys for f in k.split() if f.startswith("--")]
                  for name, keys in marked_tables(REPLAY, "flags").items()}
    listed = [f for flags in documented.values() for f in flags]
    problems = drift("docs/REPLAY.md", {"replay": listed}, {"replay": replay_flags()}, "flags")
    assert not problems, "\n".join(problems)


def config_snippets() -> list[tuple[str, dict]]:
    """(where, extra_config) of every config a user may copy: examples/vllm/*.json,
    and the JSON / YAML blocks of README.md and docs/ that hold spec keys."""
    import yaml

    found = [(p.name, json.loads(p.read_text())) for p in sorted(EXAMPLES.glob("*.json"))]
    for doc in [README, *sorted(DOCS.glob("*.md"))]:
        for lang, body in re.findall(r"```(json|yaml)\n(.*?)```", doc.read_text(encoding="utf-8"), re.S):
            try:
                data = json.loads(body) if lang == "json" else yaml.safe_load(body)
            except (ValueError, yaml.YAMLError):
                continue  # a fragment, not a config
            if isinstance(data, dict):
                found.append((f"{doc.name}: {body.splitlines()[0][:40]}", data))
    configs = []
    for where, data in found:
        extra = data.get("kv_connector_extra_config", data.get("extra_config", data))
        if isinstance(extra, dict) and extra.keys() & {"cpu_bytes_to_use", "num_cpu_chunks", "secondary_tiers"}:
            configs.append((where, extra))
    return configs


def test_config_snippets_use_documented_keys():
    """Every key of the configs README, docs/ and examples/ show is in CONFIGURATION.md's table for where it sits."""
    documented = {k: set(v) for k, v in marked_tables(CONFIGURATION, "keys").items()}
    spec_keys = documented["vllm"] | documented["cpu"] | documented["tiered"]
    snippets = config_snippets()
    assert len(snippets) >= 6  # the snippets are found at all
    problems = []
    for where, extra in snippets:
        problems += [f"{where}: {k!r}" for k in sorted(set(extra) - spec_keys)]
        problems += [f"{where}: namespace {k!r}" for k in sorted(set(extra.get("namespace") or {}) - documented["namespace"])]
        for tier in extra.get("secondary_tiers", []):
            allowed = documented["secondary_tiers"] | documented.get(tier.get("type"), set())
            problems += [f"{where}: {tier.get('type')} tier {k!r}" for k in sorted(set(tier) - allowed)]
    assert not problems, "keys no table of docs/CONFIGURATION.md lists:\n" + "\n".join(problems)


# ---- links and sizes ---------------------------------------------------------------

def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "examples").rglob("*.md"))]


def anchors(path: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (lower case, punctuation
    dropped, spaces to hyphens)."""
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def test_every_relative_link_points_to_a_file():
    broken, checked = [], 0
    for doc in doc_files():
        text = doc.read_text(encoding="utf-8")
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same file
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve()
            checked += 1
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: link to {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: link to {target} (no such heading in {file})")
    assert checked > 20  # the links are found at all
    assert not broken, "\n".join(broken)


def test_readme_is_short_and_starts_with_use():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; at most 300 (move detail to docs/)"
    vllm = [i for i, line in enumerate(lines) if line.startswith("## ") and "vLLM" in line]
    assert vllm and vllm[0] < 100, "README.md: the vLLM section must start within its first 100 lines"


def test_readme_commands_are_the_scripts_ci_runs():
    readme = README.read_text(encoding="utf-8")
    for script in ("./scripts/setup.sh", "./scripts/test.sh"):
        assert script in readme
        assert (ROOT / script).is_file()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/setup.sh" in ci and "./scripts/test.sh" in ci


def test_benchmarks_is_a_short_reference():
    text = BENCHMARKS.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 800, f"docs/BENCHMARKS.md has {len(lines)} lines; at most 800"
    dated = [h for h in lines if h.startswith("#") and
             re.search(r"\b20\d\d-\d\d-\d\d\b|\bsession\b|\bissue \d+|\b(Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]* \d", h)]
    assert not dated, f"docs/BENCHMARKS.md: dated headings: {dated}"
    machine = sorted({m for m in re.findall(r"(?<![\w.])/(?:tmp|work|root)/\S*", text)})
    assert not machine, f"docs/BENCHMARKS.md: machine paths (use repository-relative ones): {machine}"


def test_architecture_map_names_existing_paths_and_every_package():
    src = ROOT / "src" / "kvoffload"
    listed = [p for names in marked_tables(DOCS / "ARCHITECTURE.md", "paths").values() for p in names]
    assert listed, "docs/ARCHITECTURE.md: no table marked <!-- paths: src/kvoffload -->"
    missing = [p for p in listed if not (src / p).exists()]
    assert not missing, f"docs/ARCHITECTURE.md names paths under src/kvoffload/ that do not exist: {missing}"
    packages = sorted(str(d.relative_to(src)) + "/" for d in src.iterdir() if (d / "__init__.py").is_file())
    unlisted = [d for d in packages if not any(p.startswith(d) for p in listed)]
    assert not unlisted, f"docs/ARCHITECTURE.md: packages missing from the map: {unlisted}"


def test_the_python_example_of_architecture_runs():
    """The first Python block under "Using a spec from Python" stores, looks up
    and loads a chunk through the cpu spec (its own asserts check the answers)."""
    text = (DOCS / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text[text.index("## Using a spec from Python"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "docs/ARCHITECTURE.md", "exec"), {})


def test_readme_vllm_config_is_the_cpu_example():
    """The README's vLLM config is examples/vllm/cpu.json (that file may also pick a policy)."""
    text = README.read_text(encoding="utf-8")
    shown = json.loads(re.search(r"```json\n(.*?)```", text, re.S).group(1))
    example = json.loads((EXAMPLES / "cpu.json").read_text())
    extra = example.pop("kv_connector_extra_config")
    shown_extra = shown.pop("kv_connector_extra_config")
    assert shown == example
    assert {k: v for k, v in extra.items() if k != "eviction_policy"} == shown_extra
