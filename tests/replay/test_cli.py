import json

from kvoffload.cli import main


def test_default_workload_end_to_end(tmp_path, capsys):
    js, md, plots = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "plots"
    rc = main(["replay", "--sessions", "15", "--no-progress", "--oracle", "--order", "legacy", "--json", str(js),
               "--markdown", str(md), "--plot-dir", str(plots)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "prefix hit rate: offload" in out and "bytes match" in out and "Belady" in out
    s = json.loads(js.read_text())["summary"]
    assert s["requests"] > 15 and s["verify_failures"] == 0
    assert s["tokens_from_gpu_cache"] + s["tokens_from_offload"] + s["tokens_recomputed"] == s["prompt_tokens"]
    assert s["oracle:belady"] >= s["offload_prefix_hit_rate"] > 0 and s["oracle:lru"] > 0
    assert s["tiers"]["cpu"]["prefix_hit_rate"] == s["offload_prefix_hit_rate"]
    assert "| prefix hit rate: offload |" in md.read_text()
    assert (plots / "hit_rate_over_time.png").stat().st_size > 0
    assert "cpu / hubchain" in out  # the default policy, named in the report


def test_lru_replays_as_the_offline_lru_simulation(tmp_path):
    """In the legacy order (stores land at once) the live LRU tier keeps what
    the offline LRU simulation keeps: the same prefix hit rate."""
    js = tmp_path / "r.json"
    assert main(["replay", "--sessions", "15", "--no-progress", "--oracle", "--order", "legacy", "--policy", "lru",
                 "--json", str(js)]) == 0
    s = json.loads(js.read_text())["summary"]
    assert s["oracle:belady"] >= s["oracle:lru"] == s["offload_prefix_hit_rate"] > 0


def test_sweep_writes_table_and_plot(mooncake_file, tmp_path, capsys):
    p = mooncake_file([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6], [1, 2, 4]] * 4)
    # legacy order: deterministic hit rates (in vLLM's order they depend on when the copy threads finish)
    rc = main(["replay", str(p), "--block-size", "4", "--sweep", "2,50%,100", "--oracle", "--no-progress",
               "--order", "legacy", "--plot-dir", str(tmp_path), "--json", str(tmp_path / "s.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| 2 |" in out and "| 3 |" in out and "| 100 |" in out  # 50% of 6 unique blocks = 3
    assert (tmp_path / "hit_rate_vs_capacity.png").stat().st_size > 0
    points = json.loads((tmp_path / "s.json").read_text())
    rates = [pt["summary"]["offload_prefix_hit_rate"] for pt in points]
    assert rates == sorted(rates) and rates[-1] > rates[0]


def test_bad_trace_line_is_named(tmp_path, capsys):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}\n{oops\n')
    assert main(["replay", str(p), "--block-size", "4", "--no-progress"]) == 2
    assert "bad.jsonl:2: invalid JSON" in capsys.readouterr().err


def test_bad_option_values(capsys):
    assert main(["replay", "--sessions", "2", "--cpu-blocks", "0", "--no-progress"]) == 2
    assert "--cpu-blocks" in capsys.readouterr().err
    assert main(["replay", "--sessions", "2", "--policy", "nope", "--no-progress"]) == 2
    assert "unknown eviction policy 'nope'" in capsys.readouterr().err
    assert main(["replay", "--sessions", "2", "--extra", "nokey", "--no-progress"]) == 2
    assert "KEY=VALUE" in capsys.readouterr().err
    assert main(["replay", "--sessions", "2", "--time-compression", "0", "--no-progress"]) == 2
    assert "--time-compression must be a finite number > 0, got 0.0" in capsys.readouterr().err
    assert main(["replay", "--sessions", "2", "--limit", "0", "--no-progress"]) == 2
    assert "--limit" in capsys.readouterr().err


def test_cpu_bytes_and_model_preset(mooncake_file, capsys):
    p = mooncake_file([[1, 2], [1, 3], [1, 2]])
    rc = main(["replay", str(p), "--block-size", "4", "--cpu-bytes", "4MiB", "--model", "llama-3.1-8b",
               "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    # 4 tokens x 128 KiB = 512 KiB chunks: 8 of them in 4 MiB
    assert "capacity 8 blocks" in out and "sampled bytes match" in out


def test_json_report_with_metrics_and_events_endpoints(mooncake_file, tmp_path, capsys):
    """The live endpoints were kept in the report's options, which could
    not be deep-copied to JSON: the run ended in a traceback, no JSON."""
    p = mooncake_file([[1, 2], [1, 3], [1, 2]])
    js = tmp_path / "r.json"
    rc = main(["replay", str(p), "--block-size", "4", "--cpu-blocks", "2", "--no-progress", "--metrics-port", "0",
               "--events-endpoint", "tcp://127.0.0.1:*", "--json", str(js)])
    assert rc == 0
    assert "Traceback" not in capsys.readouterr().err
    report = json.loads(js.read_text())
    assert report["result"]["options"]["metrics"] == "PrometheusMetrics"
    assert report["result"]["options"]["events"] == "ZmqEventPublisher"
    assert report["summary"]["requests"] == 3


def test_parallel_sweep_prints_what_the_sequential_one_prints(mooncake_file, tmp_path, capsys):
    from kvoffload.replay.sweep import default_workers

    p = mooncake_file([[1, 2, 3], [1, 2, 4], [1, 5], [1, 2, 3, 6], [7, 1], [1, 2, 4, 8]])
    out, stats = {}, {}
    for workers in ("1", "3"):
        js = tmp_path / f"w{workers}.json"
        rc = main(["replay", str(p), "--block-size", "4", "--sweep", "1,2,4", "--sweep-workers", workers,
                   "--oracle", "--no-progress", "--json", str(js)])
        assert rc == 0
        captured = capsys.readouterr()
        out[workers] = (captured.out, captured.err)
        timing = ("_s", "GBps", "manager_ns", "harness_share")  # how long it took is the only difference
        stats[workers] = [{k: v for k, v in r["summary"].items() if not any(t in k for t in timing)}
                          for r in json.loads(js.read_text())]
    assert out["1"] == out["3"]
    assert stats["1"] == stats["3"] and [s["requests"] for s in stats["1"]] == [6, 6, 6]
    assert [line.split("]")[0] for line in out["3"][1].splitlines()] == ["[1", "[2", "[4"]
    assert 1 <= default_workers(3) <= 3 and default_workers(1) == 1
    assert main(["replay", str(p), "--sweep", "1,2", "--sweep-workers", "0"]) == 2
    assert "--sweep-workers must be positive, got 0" in capsys.readouterr().err


def test_parallel_sweep_runs_no_more_at_once_than_memory_holds():
    from kvoffload.replay.sweep import fit_workers

    assert fit_workers([10, 20, 30], 3, None) == 3
    assert fit_workers([10, 20, 30], 3, 60) == 3
    assert fit_workers([10, 20, 30], 3, 59) == 2  # the two biggest together: 50
    assert fit_workers([10, 20, 30], 2, 1000) == 2
    assert fit_workers([10, 20, 30], 3, 5) == 1  # one at a time, as the sequential run would


def _scan_and_hot() -> list[list[int]]:
    """A hot prefix read again after every two one-shot scans: LRU lets the
    scans push its tail out, ARC keeps it (blocks read twice) at 5 blocks;
    at 7 both keep it."""
    reqs, fresh = [], 100
    for _ in range(12):
        reqs.append([1, 2, 3])
        for _ in range(2):
            reqs.append([fresh, fresh + 1])
            fresh += 2
    return reqs


def test_policies_side_by_side(mooncake_file, tmp_path, capsys):
    p = mooncake_file(_scan_and_hot())
    out_json, md = tmp_path / "c.json", tmp_path / "c.md"
    # legacy order: deterministic hit rates, and the LRU sim equals the LRU replay
    rc = main(["replay", str(p), "--block-size", "4", "--policy", "lru,arc", "--sweep", "5,7", "--oracle",
               "--order", "legacy", "--no-progress", "--json", str(out_json), "--markdown", str(md),
               "--plot-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| CPU capacity (blocks) | lru | arc | best (vs lru) | LRU sim | Belady |" in out
    assert md.read_text() in out
    assert (tmp_path / "hit_rate_by_policy.png").stat().st_size > 0
    runs = json.loads(out_json.read_text())
    assert [(r["result"]["options"]["extra_config"]["eviction_policy"],
             r["result"]["options"]["extra_config"]["num_cpu_chunks"]) for r in runs] == \
        [("lru", 5), ("lru", 7), ("arc", 5), ("arc", 7)]
    rate = {(r["result"]["options"]["extra_config"]["eviction_policy"],
             r["result"]["options"]["extra_config"]["num_cpu_chunks"]): r["summary"]["offload_prefix_hit_rate"]
            for r in runs}
    # the oracles ride on the first policy's replays only (they do not depend on the policy)
    assert all("oracle:belady" in r["summary"] for r in runs[:2])
    assert not any("oracle:belady" in r["summary"] for r in runs[2:])
    assert runs[0]["summary"]["oracle:lru"] == rate[("lru", 5)]
    # each policy's column is what a replay of that policy alone gives
    for policy in ("lru", "arc"):
        alone = tmp_path / f"{policy}.json"
        assert main(["replay", str(p), "--block-size", "4", "--policy", policy, "--sweep", "5,7",
                     "--order", "legacy", "--no-progress", "--json", str(alone)]) == 0
        got = [r["summary"]["offload_prefix_hit_rate"] for r in json.loads(alone.read_text())]
        assert got == [rate[(policy, 5)], rate[(policy, 7)]]
    capsys.readouterr()
    # the best is named, with its gain over the first policy listed; a tie goes to the first
    assert rate[("arc", 5)] > rate[("lru", 5)] and rate[("arc", 7)] == rate[("lru", 7)]
    rows = out.splitlines()[2:4]
    assert rows[0].endswith(f"| **{rate[('arc', 5)]:.4f}** | arc {rate[('arc', 5)] - rate[('lru', 5)]:+.4f} |"
                            f" {rate[('lru', 5)]:.4f} | {runs[0]['summary']['oracle:belady']:.4f} |")
    assert f"| 7 | **{rate[('lru', 7)]:.4f}** | {rate[('arc', 7)]:.4f} | lru +0.0000 |" in rows[1]
    # then what each cost per block reference, against the first (figures: this run's timing)
    lines = out.splitlines()
    at = lines.index("| manager µs per block | lru | arc |")
    assert [line.split(" | ")[0] for line in lines[at + 2:at + 4]] == ["| 5", "| 7"]
    assert all(line.endswith("x) |") for line in lines[at + 2:at + 4])


def test_policy_list_errors_before_any_replay(mooncake_file, capsys):
    p = mooncake_file([[1, 2], [1, 3]])
    for value, message in (("lru,nope", "unknown eviction policy 'nope'"),
                           ("lru,arc,lru", "--policy names 'lru' twice"),
                           (" , ", "names no policy")):
        assert main(["replay", str(p), "--block-size", "4", "--policy", value, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1 and "offload prefix hit rate" not in err


def test_policies_compared_at_one_capacity_in_bytes(mooncake_file, capsys):
    """Without --sweep: one row, at the capacity asked (here in bytes: the
    row gives the blocks the tier held)."""
    p = mooncake_file(_scan_and_hot())
    # 64-byte chunks (4 tokens x 16 bytes) each padded to 4 KiB: 20 KiB holds 5
    assert main(["replay", str(p), "--block-size", "4", "--policy", "lru,arc", "--cpu-bytes", "20KiB",
                 "--order", "legacy", "--no-progress"]) == 0
    captured = capsys.readouterr()
    rates = captured.out.split("\n\n")[0]  # the hit rates' table (the costs' follows)
    rows = [line for line in rates.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 2 and rows[1].startswith("| 5 | ") and "| arc +" in rows[1]
    assert "[arc 20480 bytes] offload prefix hit rate" in captured.err


def _storage_models(root) -> list[str]:
    return sorted(json.loads(p.read_text())["model"] for p in root.glob("ns-*/namespace.json"))


def test_a_sweep_with_a_storage_tier_gives_each_point_its_own_namespace(mooncake_file, tmp_path, capsys):
    """Two points in parallel took one storage directory's lock: the second
    died ("in use by another process"), and run one after the other, a
    later point started with the blocks an earlier one stored."""
    p = mooncake_file(_scan_and_hot())
    kv = tmp_path / "kv"
    rc = main(["replay", str(p), "--block-size", "4", "--sweep", "5,7", "--sweep-workers", "2", "--sync-tiers",
               "--storage-dir", str(kv), "--storage-bytes", "1MiB", "--no-progress",
               "--json", str(tmp_path / "s.json")])
    assert rc == 0, capsys.readouterr().err
    assert _storage_models(kv) == ["unknown (replay cpu 5)", "unknown (replay cpu 7)"]
    points = json.loads((tmp_path / "s.json").read_text())
    assert [pt["summary"]["tiers"]["storage"]["blocks_at_start"] for pt in points] == [0, 0]
    # policies side by side too: one namespace per policy and capacity
    capsys.readouterr()
    assert main(["replay", str(p), "--block-size", "4", "--policy", "lru,arc", "--cpu-blocks", "5", "--sync-tiers",
                 "--storage-dir", str(tmp_path / "kv2"), "--storage-bytes", "1MiB", "--no-progress"]) == 0
    assert _storage_models(tmp_path / "kv2") == ["unknown (replay arc, cpu as asked)",
                                                 "unknown (replay lru, cpu as asked)"]


def test_a_replay_that_starts_with_an_earlier_runs_blocks_says_so(mooncake_file, tmp_path, capsys):
    """The storage tier keeps its blocks across runs (an engine's restart);
    a second replay into the same directory starts warm, and its report says
    how many blocks it found."""
    p = mooncake_file(_scan_and_hot())
    args = ["replay", str(p), "--block-size", "4", "--cpu-blocks", "5", "--sync-tiers", "--storage-dir",
            str(tmp_path / "kv"), "--storage-bytes", "1MiB", "--no-progress"]
    assert main(args + ["--json", str(tmp_path / "1.json")]) == 0
    assert "already held" not in capsys.readouterr().out
    assert main(args + ["--json", str(tmp_path / "2.json")]) == 0
    out = capsys.readouterr().out
    first, second = (json.loads((tmp_path / f"{i}.json").read_text())["summary"] for i in (1, 2))
    assert first["tiers"]["storage"]["blocks_at_start"] == 0 and first["tiers"]["cpu"]["blocks_at_start"] == 0
    held = second["tiers"]["storage"]["blocks_at_start"]
    assert held == first["tiers"]["storage"]["stored_blocks"] - first["tiers"]["storage"].get("evictions", 0) > 0
    assert f"{held:,} blocks already held (an earlier run's: this replay started warm)" in out
    assert second["offload_prefix_hit_rate"] > first["offload_prefix_hit_rate"]


def test_a_bad_namespace_in_a_sweep_with_a_storage_tier_is_named(mooncake_file, tmp_path, capsys):
    """The sweep's own namespace per point must not hide a bad one given with --extra."""
    p = mooncake_file([[1, 2], [1, 3]])
    assert main(["replay", str(p), "--block-size", "4", "--sweep", "2,3", "--storage-dir", str(tmp_path / "kv"),
                 "--storage-bytes", "1MiB", "--extra", "namespace=3", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "namespace must be a mapping, got 3" in err and len(err.strip().splitlines()) == 1
