import json

import pytest

from kvoffload.replay.generator import generate_chat
from kvoffload.replay.traces import TraceError, chain_hashes, load_trace, mix64


def test_mooncake_fields_and_hashes(mooncake_file):
    p = mooncake_file([[0, 1, 2], [0, 3]])
    tr = load_trace(p, block_size=4)
    assert [r.prompt_tokens for r in tr.requests] == [12, 8]
    assert tr.requests[0].block_hashes[0] == tr.requests[1].block_hashes[0] == mix64(0)
    assert tr.num_block_refs == 5 and tr.num_unique_blocks() == 4
    assert [r.arrival_ms for r in tr.requests] == [0.0, 10.0]


def test_partial_last_block_counts_its_tokens(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [5, 6]}) + "\n")
    tr = load_trace(p)  # mooncake: 512-token blocks
    r = tr.requests[0]
    assert tr.block_size == 512 and [tr.block_tokens(r, i) for i in range(2)] == [512, 488]


@pytest.mark.parametrize("line, msg", [
    ("{not json", "invalid JSON"),
    ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "missing field 'input_length'"),
    ('{"timestamp": 0, "input_length": 8, "output_length": 1, "hash_ids": [1]}', "hash_ids has 1 entries"),
    ('{"timestamp": 0, "input_length": 4, "output_length": -1, "hash_ids": [1]}', "output_length"),
    ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}', "hash_ids must hold"),
    ('{"timestamp": true, "input_length": 4, "output_length": 1, "hash_ids": [1]}', "timestamp"),
    ("[1, 2]", "expected a JSON object"),
])
def test_malformed_line_names_file_and_line(tmp_path, line, msg):
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]})
    p.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceError) as e:
        load_trace(p, fmt="mooncake", block_size=4)
    assert f"bad.jsonl:3:" in str(e.value) and msg in str(e.value)


def test_missing_empty_and_unknown_format(tmp_path):
    with pytest.raises(TraceError, match="cannot read trace"):
        load_trace(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        load_trace(tmp_path / "e.jsonl")
    with pytest.raises(TraceError, match="unknown trace format 'csv'"):
        load_trace(tmp_path / "e.jsonl", fmt="csv")
    (tmp_path / "one.jsonl").write_text('{"prompt": [1, 2, 3, 4]}\n')
    with pytest.raises(TraceError, match="block size must be positive, got 0"):
        load_trace(tmp_path / "one.jsonl", block_size=0)
    with pytest.raises(TraceError, match="limit must be a positive"):
        load_trace(tmp_path / "one.jsonl", limit=0)


def test_limit_keeps_first_requests(mooncake_file):
    p = mooncake_file([[i] for i in range(10)])
    assert [r.req_id for r in load_trace(p, block_size=4, limit=3).requests] == ["0", "1", "2"]


def test_bailian_detected_seconds_to_ms(tmp_path):
    p = tmp_path / "b.jsonl"
    rows = [{"chat_id": 7, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 20, "output_length": 4,
             "type": "text", "turn": 1, "hash_ids": [1, 2]},
            {"chat_id": 8, "parent_chat_id": 7, "timestamp": 2.0, "input_length": 40, "output_length": 4,
             "type": "text", "turn": 2, "hash_ids": [1, 2, 3]}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tr = load_trace(p)
    assert tr.block_size == 16
    assert [r.arrival_ms for r in tr.requests] == [1500.0, 2000.0]
    assert tr.requests[1].block_hashes[:2] == tr.requests[0].block_hashes
    p.write_text(json.dumps({k: v for k, v in rows[0].items() if k != "turn"}) + "\n")
    with pytest.raises(TraceError, match=r"b.jsonl:1: missing field 'turn'"):
        load_trace(p)


def test_token_prompts_hash_as_prefix_chain(tmp_path):
    p = tmp_path / "tok.jsonl"
    a = list(range(10))
    b = a[:8] + [99, 98, 97, 96]
    c = [5] + a[1:]
    p.write_text("".join(json.dumps({"prompt": x}) + "\n" for x in (a, b, c)))
    tr = load_trace(p, block_size=4)
    ha, hb, hc = (r.block_hashes for r in tr.requests)
    assert len(ha) == 2 and len(hb) == 3  # full blocks only
    assert hb[:2] == ha and hb[2] not in ha
    assert not set(hc) & set(ha)  # an early difference changes every later hash
    assert chain_hashes(a, 4) == ha
    p.write_text('{"prompt": [1, "x"]}\n')
    with pytest.raises(TraceError, match="tok.jsonl:1: prompt must be a list of integer"):
        load_trace(p)


def test_generator_is_seeded_and_multi_turn():
    a = generate_chat(seed=3, sessions=10)
    b = generate_chat(seed=3, sessions=10)
    c = generate_chat(seed=4, sessions=10)
    assert [r.block_hashes for r in a.requests] == [r.block_hashes for r in b.requests]
    assert [r.block_hashes for r in a.requests] != [r.block_hashes for r in c.requests]
    assert all(x.arrival_ms <= y.arrival_ms for x, y in zip(a.requests, a.requests[1:]))
    by_session: dict[str, list] = {}
    for r in a.requests:
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for prev, nxt in zip(turns, turns[1:]):
            # the next turn repeats the previous prompt and its answer
            assert nxt.block_hashes[: len(prev.block_hashes)] == prev.block_hashes
            assert nxt.block_hashes[len(prev.block_hashes):][: len(prev.decode_hashes)] == prev.decode_hashes


def test_bailian_sessions_follow_parent_chat_ids_to_the_root(tmp_path):
    """qwen-bailian-usagetraces-anon: parent_chat_id is the previous turn's
    chat_id, -1 at a session's first turn."""
    rows = [(1, -1), (2, -1), (3, 1), (4, 3), (5, 2), (6, 99)]  # (chat_id, parent_chat_id); 99 began before the trace
    p = tmp_path / "b.jsonl"
    p.write_text("".join(json.dumps({"chat_id": c, "parent_chat_id": par, "timestamp": i, "input_length": 16,
                                     "output_length": 1, "type": "text", "turn": 1, "hash_ids": [c]}) + "\n"
                         for i, (c, par) in enumerate(rows)))
    assert [r.session for r in load_trace(p).requests] == ["1", "2", "1", "1", "2", "99"]


@pytest.mark.parametrize("sessions, limit", [(40, 1), (40, 17), (40, 39), (5, 100)])
def test_generator_limit_is_the_first_requests_of_the_whole_workload(sessions, limit):
    """--limit builds only the sessions it needs (a huge --sessions with --limit 1 took minutes)."""
    whole = generate_chat(seed=3, sessions=sessions, block_size=16)
    cut = generate_chat(seed=3, sessions=sessions, block_size=16, limit=limit)
    assert [vars(r) for r in cut.requests] == [vars(r) for r in whole.requests[:limit]]
