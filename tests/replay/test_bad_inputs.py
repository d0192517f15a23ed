"""Every bad input to `kvoffload replay` / `kvoffload demo` ends in one
line naming the option (or file and line) and the bad value, exit code 2:
never a traceback, never a hang. Sizes the machine cannot hold are refused
before anything is allocated."""

import json
import subprocess
import sys

import pytest

from kvoffload.cli import main
from kvoffload.config import memory_available

GOOD = {"timestamp": 0, "input_length": 8, "output_length": 3, "hash_ids": [1, 2]}


def one_line(capsys, argv: list[str], quiet: bool = True) -> str:
    """Run the CLI; the single line it printed on stderr (and, if quiet,
    nothing on stdout: refused before the replay)."""
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's errors exit
        rc = e.code
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    assert rc == 2, out
    assert out.out == "" or not quiet
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    return lines[0]


@pytest.fixture
def good_trace(tmp_path):
    p = tmp_path / "good.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "timestamp": 10}) + "\n")
    return p


def replay(trace, *options: str) -> list[str]:
    return ["replay", str(trace), "--block-size", "4", "--cpu-blocks", "2", "--no-progress", *options]


def test_nan_timestamp_with_trace_arrival_is_refused_not_a_hang(tmp_path):
    p = tmp_path / "nan.jsonl"
    p.write_text(json.dumps(GOOD) + "\n" + json.dumps(GOOD).replace('"timestamp": 0', '"timestamp": NaN') + "\n")
    # a subprocess: the bug was an endless loop
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", *replay(p, "--arrival", "trace")],
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"kvoffload replay: {p}:2: timestamp must be a finite non-negative number, got nan"]


@pytest.mark.parametrize("line, message", [
    ('{"timestamp": Infinity, "input_length": 4, "output_length": 1, "hash_ids": [1]}',
     "timestamp must be a finite non-negative number, got inf"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 1e20, "hash_ids": [1]}',
     "output_length must be a non-negative integer, got 1e+20"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 100000000000000000000, "hash_ids": [1]}',
     "output_length must be at most 2147483647 tokens, got 100000000000000000000"),
    ('{"prompt": [1e26, 2, 3]}', "prompt must be a list of integer token ids"),
    ('{"prompt": [100000000000000000000000000, 2, 3]}',
     "prompt token ids must be in [0, 9223372036854775807], got 100000000000000000000000000"),
    ('{"prompt": [1, -2, 3]}', "prompt token ids must be in [0, 9223372036854775807], got -2"),
    ("[" * 200_000, "invalid JSON: nested too deeply"),
])
def test_bad_trace_line_names_file_line_and_value(tmp_path, capsys, line, message):
    p = tmp_path / "bad.jsonl"
    p.write_text(line + "\n")
    assert one_line(capsys, ["replay", str(p), "--block-size", "4", "--no-progress"]) == \
        f"kvoffload replay: {p}:1: {message}"


def test_non_utf8_trace_names_the_line(tmp_path, capsys):
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(json.dumps(GOOD).encode() + b'\n{"chat": "caf\xe9"}\n')
    assert one_line(capsys, replay(p)) == f"kvoffload replay: {p}:2: not UTF-8 text (byte 14 of the line: b'\\xe9')"


def test_trace_that_is_a_directory(tmp_path, capsys):
    # a directory is read as agentic traces (replay/agentic.py); one without any is named
    assert one_line(capsys, replay(tmp_path)) == \
        f"kvoffload replay: {tmp_path}: no *.json agentic traces in this directory"
    assert one_line(capsys, replay(tmp_path, "--format", "mooncake")) == \
        f"kvoffload replay: cannot read trace {tmp_path}: Is a directory"


@pytest.mark.parametrize("options, message", [
    (["--cpu-blocks", "inf%"], "--cpu-blocks: cannot parse 'inf%' (blocks, or a share such as 5%)"),
    (["--cpu-blocks", "nan%"], "--cpu-blocks: cannot parse 'nan%' (blocks, or a share such as 5%)"),
    (["--cpu-bytes", "1e400GiB"], "--cpu-bytes: '1e400GiB' is not a finite size"),
    (["--cpu-bytes", "infGiB"], "--cpu-bytes: 'infGiB' is not a finite size"),
    (["--remote-url", "redis://[::1"], "--remote-url 'redis://[::1': Invalid IPv6 URL"),
    (["--remote-url", "redis://user:hunter2@127.0.0.1:99999"],
     "--remote-url 'redis://user:***@127.0.0.1:99999': Port out of range 0-65535"),
    (["--metrics-port", "-1"], "--metrics-port must be a TCP port in 0..65535 (0: any free one), got -1"),
    (["--metrics-port", "65536"], "--metrics-port must be a TCP port in 0..65535 (0: any free one), got 65536"),
    (["--sweep", ","], "--sweep ',' names no capacity (e.g. 1%,5%,1000)"),
    (["--hold", "-1"], "--hold must be a finite number >= 0, got -1.0"),
    (["--hold", "nan"], "--hold must be a finite number >= 0, got nan"),
    (["--hold", "1e300"], "--hold must be at most 31536000 seconds (a year), got 1e+300"),
    (["--prefill-tokens-per-s", "inf"], "--prefill-tokens-per-s must be a finite number > 0, got inf"),
    (["--time-compression", "inf"], "--time-compression must be a finite number > 0, got inf"),
    (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token must be positive, got 0"),
    (["--kv-bytes-per-token", "1e12"], "argument --kv-bytes-per-token: invalid int value: '1e12'"),
    (["--max-running", "x"], "argument --max-running: invalid int value: 'x'"),
])
def test_bad_option_is_one_line(good_trace, capsys, options, message):
    assert one_line(capsys, replay(good_trace, *options)) == f"kvoffload replay: {message}"


def test_output_paths_are_checked_before_the_replay(good_trace, tmp_path, capsys):
    assert one_line(capsys, replay(good_trace, "--json", str(tmp_path))) == \
        f"kvoffload replay: --json {str(tmp_path)!r} is a directory; give a file path"
    assert one_line(capsys, replay(good_trace, "--markdown", str(tmp_path))) == \
        f"kvoffload replay: --markdown {str(tmp_path)!r} is a directory; give a file path"
    assert one_line(capsys, replay(good_trace, "--plot-dir", str(good_trace))) == \
        f"kvoffload replay: --plot-dir {str(good_trace)!r} is not a directory"


def test_unwritable_output_is_one_line(good_trace, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    line = one_line(capsys, replay(good_trace, "--json", str(tmp_path / "file" / "r.json")), quiet=False)
    assert line == f"kvoffload replay: {tmp_path / 'file'}: File exists"  # where r.json's folder should be


def _too_big(nbytes: int) -> None:
    avail = memory_available()
    if avail is None or avail >= nbytes:  # the check needs a machine smaller than the ask
        pytest.skip(f"this machine has {avail} bytes available")


def test_cpu_tier_larger_than_memory_is_refused(good_trace, capsys):
    _too_big(2**40)
    line = one_line(capsys, replay(good_trace, "--cpu-bytes", "1TiB"))
    assert line.startswith("kvoffload replay: cpu_bytes_to_use=1099511627776 needs 1099511627776 bytes (1.0 TiB), "
                           "but this machine has ")
    assert line.endswith(" of memory available")


def test_simulated_gpu_larger_than_memory_is_refused(good_trace, capsys):
    _too_big(10**12 * 4)
    line = one_line(capsys, replay(good_trace, "--kv-bytes-per-token", "1000000000000"))
    assert line.startswith("kvoffload replay: the simulated GPU KV cache (2 blocks of 4000000000000 bytes")
    assert "needs 8000000000000 bytes (7.3 TiB), but this machine has " in line


def test_demo_bad_sizes(capsys):
    assert one_line(capsys, ["demo", "--page-kib", "1e8"]) == \
        "kvoffload demo: argument --page-kib: invalid int value: '1e8'"
    _too_big(2 * 4 * 64 * 10**8 * 1024)
    line = one_line(capsys, ["demo", "--page-kib", "100000000"])
    assert line.startswith("kvoffload demo: the demo's KV caches (4 layers x 64 blocks x --page-kib 100000000) "
                           "needs 52428800000000 bytes")
    assert line.endswith(" of memory available")
