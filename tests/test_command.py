"""The `kvoffload` command itself: its command list, and that it imports only
the module of the command it runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvoffload.cli import COMMANDS, main


def test_help_lists_every_command_without_importing_torch():
    code = ("import sys\nfrom kvoffload.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch imported:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    flat = " ".join(out.split())  # argparse wraps the help lines
    for name, (_, help_) in COMMANDS.items():
        assert f"{name} {help_}" in flat
    assert "torch imported: False" in out


def test_each_command_parses_its_own_options(capsys):
    for name in COMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0
        assert f"kvoffload {name}" in capsys.readouterr().out  # its own usage line, not the top level's


def test_unknown_command_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["nope"], "kvoffload: argument COMMAND: invalid choice: 'nope' (choose from 'replay', 'demo', 'stats', 'storage', 'vllm', 'vllm-demo-model')"),
    (["replay", "a", "b"], "kvoffload: unrecognized arguments: b"),  # the top-level parser's error
    (["stats"], "kvoffload stats: the following arguments are required: url"),
    (["stats", "x", "--interval", "abc"], "kvoffload stats: argument --interval: invalid float value: 'abc'"),
    (["storage", "check"], "kvoffload storage check: the following arguments are required: dir"),
    (["storage", "bogus", "/tmp"], "kvoffload storage: argument ACTION: invalid choice: 'bogus' (choose from 'check')"),
])
def test_every_parsers_errors_are_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    out = capsys.readouterr()
    assert out.err.splitlines() == [message] and out.out == ""  # no usage block
