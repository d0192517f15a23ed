"""The replay report's per-tier distance from Belady (the headroom a better
policy could take), on the user's own trace."""

import json

from kvoffload.cli import main
from kvoffload.replay.oracle import replay_oracles, simulate

TRACE = [[1, 2, 3], [1, 2, 4], [5, 6], [1, 2, 3], [5, 6, 7], [1, 2, 4, 8]]


def _tier(cap, composite=False):
    return {"composite": composite, "counters": {}, "gauges": {} if cap is None else {"capacity_blocks": cap}}


def test_belady_per_tier_at_the_capacity_of_the_tiers_down_to_it():
    o = replay_oracles(TRACE, {"tiered": _tier(None, True), "cpu": _tier(2), "storage": _tier(3),
                               "remote": _tier(None)}, 99)
    assert o["per_tier"] == {"cpu": {"capacity_blocks": 2, "belady": simulate(TRACE, 2, "belady").hit_rate},
                             "storage": {"capacity_blocks": 5, "belady": simulate(TRACE, 5, "belady").hit_rate}}
    assert "remote" not in o["per_tier"]  # unknown size: no figure rather than a wrong one


def test_tiered_replay_reports_each_tiers_headroom(tmp_path, capsys):
    js = tmp_path / "r.json"
    rc = main(["replay", "--sessions", "20", "--no-progress", "--oracle", "--cpu-blocks", "20",
               "--storage-dir", str(tmp_path / "kv"), "--storage-bytes", "1MiB", "--json", str(js)])
    out = capsys.readouterr().out
    assert rc == 0
    s = json.loads(js.read_text())["summary"]
    cpu, storage = s["tiers"]["cpu"], s["tiers"]["storage"]
    assert cpu["belady_capacity_blocks"] == 20 == s["oracle:capacity_blocks"]
    assert cpu["belady_prefix_hit_rate"] == s["oracle:belady"]
    assert cpu["belady_headroom"] == cpu["belady_prefix_hit_rate"] - cpu["prefix_hit_rate"]
    assert storage["belady_capacity_blocks"] == s["oracle:all_tiers_capacity_blocks"] > 20
    assert storage["belady_prefix_hit_rate"] == s["oracle:all_tiers_belady"]
    both = cpu["prefix_hit_rate"] + storage["prefix_hit_rate"]
    assert abs(storage["belady_headroom"] - (storage["belady_prefix_hit_rate"] - both)) < 1e-12
    assert "vs Belady at 20 blocks" in out and "tiers down to storage together" in out


def test_without_oracle_the_report_says_how_to_see_the_headroom(capsys):
    assert main(["replay", "--sessions", "5", "--no-progress", "--cpu-blocks", "20"]) == 0
    assert "add --oracle to see each tier's distance from the optimum" in capsys.readouterr().out
