"""`hubchain` end to end: agent conversations whose contexts outgrow the cache,
replayed in vLLM's call order (a request finishes before its stores land)
through the real cpu spec, every loaded byte checked."""

import json

from kvoffload.cli import main


def agent(path, conv: int, turns: int = 8) -> None:
    """One conversation: each turn re-reads the whole context, 8 blocks more each time."""
    ids = list(range(conv * 1000, conv * 1000 + 8 * (turns + 1)))
    reqs = [{"t": 5.0 * i, "type": "n", "in": 4 * 8 * (i + 1), "out": 2, "hash_ids": ids[:8 * (i + 1)]}
            for i in range(turns)]
    path.write_text(json.dumps({"id": f"c{conv}", "block_size": 4, "hash_id_scope": "local", "requests": reqs}))


def replay(d, policy, tmp_path):
    js = tmp_path / f"{policy}.json"
    assert main(["replay", str(d), "--cpu-blocks", "12", "--stagger", "2", "--policy", policy,
                 "--verify", "all", "--no-progress", "--json", str(js)]) == 0
    return json.loads(js.read_text())["summary"]


def test_hubchain_keeps_the_heads_where_lru_loops(tmp_path):
    d = tmp_path / "agents"
    d.mkdir()
    for conv in range(2):
        agent(d / f"trace_{conv}.json", conv)
    lru, hub = replay(d, "lru", tmp_path), replay(d, "hubchain", tmp_path)
    for s in (lru, hub):
        assert s["verify_failures"] == 0 and s["load_failures"] == 0 and s["store_failures"] == 0
    assert hub["verified_blocks"] > 0
    assert hub["offload_prefix_hit_rate"] >= 2 * lru["offload_prefix_hit_rate"] > 0
