"""--hint-final-turns: requests whose new blocks are never reused carry
kv_retention=low, and the replay's hit rate shows what the hint is worth."""

import json

from kvoffload.cli import main
from kvoffload.replay.traces import load_trace, mark_final_turns


def test_mark_final_turns_marks_requests_whose_new_blocks_are_never_reused(mooncake_file):
    p = mooncake_file([[0, 1, 2], [0, 1, 2, 3], [0, 9], [0, 1, 2, 3, 4], [0, 1]])
    trace = load_trace(p, block_size=4)
    assert mark_final_turns(trace) == 3
    low = [r.kv_transfer_params == {"kv_retention": "low"} for r in trace.requests]
    # r0 is continued by r1 (blocks 1, 2), r1 by r3 (block 3); r2's block 9,
    # r3's block 4 are never seen again, r4 stores nothing new.
    assert low == [False, False, True, True, True]


def test_final_turn_hints_raise_the_hit_rate_on_the_shared_trace(mooncake_path, tmp_path):
    def rate(*flags):
        out = tmp_path / f"r{len(flags)}.json"
        # legacy order: deterministic (in vLLM's order hits depend on when the copy threads finish)
        assert main(["replay", str(mooncake_path), "--limit", "3000", "--cpu-blocks", "3000", "--order", "legacy",
                     "--no-progress", "--json", str(out), *flags]) == 0
        s = json.loads(out.read_text())["summary"]
        assert s["verify_failures"] == 0
        return s["offload_prefix_hit_rate"]

    plain, hinted = rate(), rate("--hint-final-turns")
    assert hinted > plain + 0.02
