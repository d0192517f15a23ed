"""The engine-time model: a step lasts its compute time and the tiers below
CPU move bytes at a modeled bandwidth on a simulated clock, so the same
replay gives the same figures on a quiet or a busy machine."""

import json
import threading

import pytest

from kvoffload.cli import main
from kvoffload.replay.engine import EngineOptions, replay
from kvoffload.replay.generator import generate_chat
from kvoffload.replay.report import summary
from kvoffload.replay.traces import load_trace

WALL_CLOCK = ("load_time_s", "store_time_s")  # the only counters measured in wall time


def tiered(tmp_path, name, cpu_blocks=24, **kw):
    extra = {"num_cpu_chunks": cpu_blocks, "eviction_policy": kw.pop("policy", "lru"),
             "storage_dir": str(tmp_path / name), "storage_bytes": 600 * 4096}
    return EngineOptions(spec="tiered", extra_config=extra, progress=False, time_model="engine",
                         max_batched_tokens=512, **kw)


def figures(r):
    """Everything a replay reports that is not a wall-clock time."""
    s = summary(r)
    counters = {k: v for k, v in r.counters.items() if k not in WALL_CLOCK}
    tiers = {n: (t["prefix_hit_rate"], t["counters"]) for n, t in s["tiers"].items()}
    return counters, tiers


class Busy:
    """A thread keeping the interpreter busy: the machine under load."""

    def __enter__(self):
        self.stop = threading.Event()
        self.t = threading.Thread(target=self._spin, daemon=True)
        self.t.start()

    def _spin(self):
        while not self.stop.is_set():
            sum(range(20_000))

    def __exit__(self, *exc):
        self.stop.set()
        self.t.join()


@pytest.mark.parametrize("policy", ["lru", "hubchain"])
def test_same_replay_same_figures_on_a_quiet_and_a_busy_machine(tmp_path, policy):
    trace = generate_chat(seed=3, sessions=30, block_size=64)
    quiet = replay(trace, tiered(tmp_path, "a", policy=policy))
    with Busy():
        busy = replay(trace, tiered(tmp_path, "b", policy=policy))
    assert figures(quiet) == figures(busy)
    counters, tiers = figures(quiet)
    # the storage tier took part: written down, and read back for hits
    assert tiers["storage"][1]["cascaded_blocks"] > 0 and tiers["storage"][1].get("promoted_blocks", 0) > 0
    assert counters["verify_failures"] == 0


def test_a_slower_tier_keeps_the_engine_waiting_longer(tmp_path):
    trace = generate_chat(seed=3, sessions=30, block_size=64)
    fast = replay(trace, tiered(tmp_path, "a", tier_bandwidth={"storage": 1e12}))
    slow = replay(trace, tiered(tmp_path, "b", tier_bandwidth={"storage": 1e8}))
    assert slow.counters["tier_wait_s"] > fast.counters["tier_wait_s"]
    assert slow.counters["sim_time_ms"] > fast.counters["sim_time_ms"]
    assert fast.tiers["storage"]["engine_time"]["bandwidth_Bps"] == 1e12
    # the compute is the same work at the same rates: only the waits differ
    assert slow.counters["compute_s"] == pytest.approx(fast.counters["compute_s"], rel=0.2)


def test_a_step_lasts_its_prefill_and_decode_time(mooncake_file):
    # no block repeats: every prompt token is computed
    tr = load_trace(mooncake_file([[1, 2, 3], [4, 5], [6, 7, 8, 9]], block_size=4), block_size=4)
    o = EngineOptions(extra_config={"num_cpu_chunks": 100}, progress=False, time_model="engine",
                      prefill_tokens_per_s=1000.0, decode_tokens_per_s=10.0)
    r = replay(tr, o)
    c = r.counters
    expected = c["prompt_tokens"] / 1000.0 + sum(q.output_tokens for q in tr.requests) / 10.0
    assert c["recomputed_tokens"] == c["prompt_tokens"] == 36
    assert c["compute_s"] == pytest.approx(expected)
    assert c["sim_time_ms"] >= 1000 * expected


def run_json(argv, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["replay", *argv, "--no-progress", "--json", str(out)]) == 0
    return json.loads(out.read_text())["result"], capsys.readouterr()


def test_engine_time_is_the_default_with_a_tier_below_cpu(tmp_path, capsys):
    base = ["--sessions", "6", "--cpu-blocks", "20%"]
    cpu_only, _ = run_json(base, tmp_path, capsys)
    assert cpu_only["options"]["time_model"] == "fast" and cpu_only["options"]["max_batched_tokens"] == 0
    storage = ["--storage-dir", str(tmp_path / "kv"), "--storage-blocks", "50%"]
    tiered_run, _ = run_json(base + storage, tmp_path, capsys)
    assert tiered_run["options"]["time_model"] == "engine"
    assert tiered_run["options"]["max_batched_tokens"] == 8192  # the engine's chunked prefill
    # --storage-blocks: that many one-block slots
    assert tiered_run["tiers"]["storage"]["gauges"]["capacity_blocks"] == \
        round(0.5 * cpu_only["options"]["extra_config"]["num_cpu_chunks"] / 0.2)
    synced, _ = run_json(base + storage + ["--sync-tiers"], tmp_path, capsys)
    assert synced["options"]["time_model"] == "fast"


def test_a_cpu_tier_too_small_for_the_longest_prompt_is_warned(tmp_path, mooncake_file, capsys):
    p = mooncake_file([list(range(1, 11)), list(range(20, 24)), list(range(1, 11))], block_size=64)
    tiers = ["--block-size", "64", "--storage-dir", str(tmp_path / "kv"), "--storage-blocks", "100"]
    small, out = run_json([str(p), "--cpu-blocks", "8", *tiers], tmp_path, capsys)
    line = ("kvoffload replay: warning: the CPU tier (8 blocks) is smaller than this trace needs (20: twice its "
            "longest prompt, 10 blocks;")
    assert line in out.err
    # half of CPU (4) returns from below: 6 + 0 + 6 of the 24 prompt blocks are beyond it
    assert "50.0% of the prompt blocks are out of their reach" in out.err
    assert "WARNING" in out.out
    _, out = run_json([str(p), "--cpu-blocks", "20", *tiers], tmp_path, capsys)
    assert "warning" not in out.err and "WARNING" not in out.out


def test_a_bandwidth_for_no_such_tier_is_one_line(tmp_path, capsys):
    argv = ["replay", "--sessions", "3", "--no-progress", "--storage-dir", str(tmp_path / "kv"),
            "--storage-blocks", "50%", "--tier-bandwidth", "ssd=1GB/s"]
    assert main(argv) == 2
    out = capsys.readouterr()
    assert out.err == ("kvoffload replay: tier bandwidth given for 'ssd': no such tier below CPU "
                       "(the tiers: storage)\n")


def test_with_trace_arrivals_the_tiers_work_through_the_idle_gaps(tmp_path):
    """Requests far apart in time: the tiers work through the gaps, so the
    engine waits on them only for the promotions its requests ask for."""
    trace = generate_chat(seed=3, sessions=6, block_size=64)
    for i, r in enumerate(trace.requests):
        r.arrival_ms = 60_000.0 * i  # a minute apart: far more than any job takes
    o = tiered(tmp_path, "a", arrival="trace")
    r = replay(trace, o)
    assert r.counters["sim_time_ms"] >= trace.requests[-1].arrival_ms
    assert r.counters["tier_wait_s"] < 0.01 * r.counters["sim_time_ms"] / 1000
    storage = r.tiers["storage"]
    assert storage["counters"]["cascaded_blocks"] > 0 and storage["engine_time"]["busy_share"] < 0.01
    assert storage["engine_time"]["peak_backlog_s"] < 60  # a job never waited for one from an earlier gap
    assert not storage["counters"].get("dropped_stores")
