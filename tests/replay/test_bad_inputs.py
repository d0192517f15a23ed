"""Every bad input to `kvoffload replay` / `kvoffload demo` ends in one
line naming the option (or file and line) and the bad value, exit code 2:
never a traceback, never a hang. Sizes the machine cannot hold are refused
before anything is allocated."""

import json
import os
import subprocess
import sys

import pytest

from kvoffload.cli import main
from kvoffload.config import memory_available
from kvoffload.replay.models import MODEL_PRESETS

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
    cap = [] if "--cpu-bytes" in options else ["--cpu-blocks", "2"]  # alternatives: one or the other
    return ["replay", str(trace), "--block-size", "4", *cap, "--no-progress", *options]


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
    # --extra sizes: the spec's rules, before the memory estimate read them (tracebacks, or no key named)
    (["--extra", "num_cpu_chunks=1e999"], "num_cpu_chunks must be a positive integer, got inf"),
    (["--extra", "num_cpu_chunks=Infinity"], "num_cpu_chunks must be a positive integer, got inf"),
    (["--extra", "num_cpu_chunks=NaN"], "num_cpu_chunks must be a positive integer, got nan"),
    (["--extra", "num_cpu_chunks=null"], "num_cpu_chunks must be a positive integer, got None"),
    (["--cpu-bytes", "1MiB", "--extra", "cpu_bytes_to_use=[1]"], "cpu_bytes_to_use must be a positive integer, got [1]"),
    (["--extra", "offload_prompt_only=maybe"], "offload_prompt_only must be true or false, got 'maybe'"),
    (["--extra", "eviction_policy=" + "[" * 50_000 + "]" * 50_000], "--extra eviction_policy: JSON nested too deeply"),
    (["--extra", "x=" + "1" * 5000], "--extra x: Exceeds the limit (4300 digits) for integer string conversion: "
                                     "value has 5000 digits; use sys.set_int_max_str_digits() to increase the limit"),
    # alternatives given together: one was silently ignored
    (["--cpu-bytes", "1MiB", "--cpu-blocks", "5"], "--cpu-bytes and --cpu-blocks are alternatives; give one"),
    (["--cpu-bytes", "1MiB", "--sweep", "5,6"], "--cpu-bytes and --sweep are alternatives; give one"),
    (["--storage-bytes", "1MiB", "--storage-blocks", "5"], "--storage-bytes and --storage-blocks are alternatives; give one"),
    (["--sync-tiers", "--time-model", "engine"], "--sync-tiers and --time-model engine are alternatives; give one"),
    # the engine-time options
    (["--time-model", "slow"], "argument --time-model: invalid choice: 'slow' (choose from 'auto', 'engine', 'fast')"),
    (["--model", "gpt-5"], "argument --model: invalid choice: 'gpt-5' (choose from "
     + ", ".join(f"'{m}'" for m in sorted(MODEL_PRESETS)) + ")"),
    (["--decode-tokens-per-s", "0"], "--decode-tokens-per-s must be a finite number > 0, got 0.0"),
    (["--decode-tokens-per-s", "nan"], "--decode-tokens-per-s must be a finite number > 0, got nan"),
    (["--prefill-tokens-per-s", "-5"], "--prefill-tokens-per-s must be a finite number > 0, got -5.0"),
    (["--tier-bandwidth", "storage"], "--tier-bandwidth 'storage': expected NAME=RATE, e.g. storage=2GB/s"),
    (["--tier-bandwidth", "storage=fast"],
     "--tier-bandwidth 'storage=fast': cannot parse the rate 'fast' (bytes per second, e.g. 2GB/s or 2e9)"),
    (["--tier-bandwidth", "storage=0"], "--tier-bandwidth 'storage=0': the rate must be a finite number > 0"),
    (["--tier-bandwidth", "storage=inf"], "--tier-bandwidth 'storage=inf': the rate must be a finite number > 0"),
    (["--storage-blocks", ""], "--storage-blocks is empty (''); give a value or leave the option out"),
    # an empty value was silently the default
    (["--cpu-blocks", ""], "--cpu-blocks is empty (''); give a value or leave the option out"),
    (["--cpu-bytes", " "], "--cpu-bytes is empty (' '); give a value or leave the option out"),
    (["--remote-url", ""], "--remote-url is empty (''); give a value or leave the option out"),
    (["--storage-dir", "", "--storage-bytes", "4MiB"], "--storage-dir is empty (''); give a value or leave the option out"),
    (["--json", ""], "--json is empty (''); give a value or leave the option out"),
    (["--seed", "-1"], "--seed must be 0 or more, got -1"),
    (["--sessions", "99999999999"], "--sessions must be at most 10000000, got 99999999999"),
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


def test_unwritable_output_is_refused_before_the_replay(good_trace, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "sub" / "r.json")  # where r.json's folder should be, a file
    assert one_line(capsys, replay(good_trace, "--json", out)) == \
        f"kvoffload replay: --json {out!r}: {str(tmp_path / 'file')!r} is not a directory"
    assert one_line(capsys, replay(good_trace, "--plot-dir", out)) == \
        f"kvoffload replay: --plot-dir {out!r}: {str(tmp_path / 'file')!r} is not a directory"
    # root's access() says yes to it; opening it to write does not
    assert one_line(capsys, replay(good_trace, "--markdown", "/proc/version")) == \
        "kvoffload replay: --markdown '/proc/version': Invalid argument"


def test_output_in_a_read_only_folder_is_refused_before_the_replay(good_trace, tmp_path, capsys):
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "old.md").write_text("kept")
    (tmp_path / "ro").chmod(0o500)
    try:
        if os.access(tmp_path / "ro", os.W_OK):  # root
            pytest.skip("root writes into read-only folders")
        assert one_line(capsys, replay(good_trace, "--markdown", str(tmp_path / "ro" / "new.md"))) == \
            f"kvoffload replay: --markdown {str(tmp_path / 'ro' / 'new.md')!r}: {str(tmp_path / 'ro')!r} is not writable"
    finally:
        (tmp_path / "ro").chmod(0o700)
    assert (tmp_path / "ro" / "old.md").read_text() == "kept"


def test_the_output_check_leaves_files_as_they_were(good_trace, tmp_path, capsys):
    old = tmp_path / "old.json"
    old.write_text("kept")
    one_line(capsys, replay(good_trace, "--json", str(old), "--seed", "-1"))  # refused after the output check
    assert old.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["good.jsonl", "old.json"]


def test_markdown_of_a_trace_with_a_non_utf8_name(tmp_path):
    name = os.fsdecode(b"caf\xe9.jsonl")  # holds a surrogate: write_text raised UnicodeEncodeError
    (tmp_path / name).write_text(json.dumps(GOOD) + "\n")
    # a subprocess: its stdout writes the name's byte back as the terminal would (pytest's refuses it)
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli",
                           *replay(tmp_path / name, "--markdown", str(tmp_path / "r.md"))],
                          capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "caf\\udce9.jsonl" in (tmp_path / "r.md").read_text(encoding="utf-8")


def test_a_failed_write_names_the_option_and_file(good_trace, capsys):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    line = one_line(capsys, replay(good_trace, "--markdown", "/dev/full"), quiet=False)  # after the replay
    assert line == "kvoffload replay: cannot write --markdown '/dev/full': No space left on device"


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


def test_same_file_for_json_and_markdown(good_trace, tmp_path, capsys):
    a, b = tmp_path / "out", tmp_path / "sub" / ".." / "out"
    assert one_line(capsys, replay(good_trace, "--json", str(a), "--markdown", str(b))) == \
        f"kvoffload replay: --json and --markdown name the same file {str(b)!r}; give two"


def test_empty_trace_path_is_not_the_generated_workload(capsys):
    assert one_line(capsys, ["replay", "", "--no-progress"]) == \
        "kvoffload replay: the trace path is empty (''); give a value or leave the option out"


def test_policy_that_is_no_module_names_itself(good_trace, capsys):
    for policy in (":", ".x"):
        line = one_line(capsys, replay(good_trace, "--policy", policy))
        assert line.startswith(f"kvoffload replay: cannot load eviction policy {policy!r}: ")  # was "Empty module name"


@pytest.mark.parametrize("extra", [["--extra", "cpu_bytes_to_use=8MiB"],
                                   ["--cpu-bytes", "1MiB", "--extra", "cpu_bytes_to_use=8MiB"]])
def test_extra_cpu_bytes_with_a_unit_is_accepted(good_trace, capsys, extra):
    # the memory estimate ran int('8MiB'); alone, the default --cpu-blocks 10% made it "not both"
    argv = ["replay", str(good_trace), "--block-size", "4", "--no-progress", *extra]
    assert main(argv) == 0, capsys.readouterr().err
    assert "capacity" in capsys.readouterr().out


def test_default_capacity_that_gives_no_blocks_says_it_is_the_default(good_trace, capsys):
    # 10% of the trace's 2 unique blocks; the user gave no --cpu-blocks
    assert one_line(capsys, ["replay", str(good_trace), "--block-size", "4", "--no-progress"]) == \
        "kvoffload replay: --cpu-blocks (default 10%): '10%' gives 0 blocks; need at least 1"


def test_metrics_port_in_use_names_the_port(good_trace, capsys):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        line = one_line(capsys, replay(good_trace, "--metrics-port", str(port)))
    assert line == f"kvoffload replay: --metrics-port {port}: Address already in use"


def test_huge_sessions_with_a_limit_builds_only_what_it_replays():
    # a subprocess with a timeout: it built every session first (minutes) before cutting to --limit
    proc = subprocess.run([sys.executable, "-m", "kvoffload.cli", "replay", "--sessions", "200000", "--limit", "2",
                           "--cpu-blocks", "2", "--no-progress"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert "requests                       2\n" in proc.stdout


@pytest.mark.parametrize("seed", ["99999999999999999999999", "-1"])
def test_demo_seed_out_of_range_names_the_option(capsys, seed):
    assert one_line(capsys, ["demo", "--seed", seed]) == f"kvoffload demo: --seed must be in [0, 2**64), got {seed}"


def test_generated_workload_larger_than_memory_is_refused(capsys):
    _too_big(10**7 * 400_000)
    line = one_line(capsys, ["replay", "--sessions", "10000000", "--block-size", "1", "--no-progress"])
    assert line.startswith("kvoffload replay: the generated workload (10,000,000 sessions of --sessions 10,000,000 "
                           "at --block-size 1) needs ")
    assert line.endswith(" of memory available")
