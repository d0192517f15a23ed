"""kv-cache-tester's agentic traces: loading, id scopes, sub-agents, stagger,
and a directory replayed end to end through the CLI."""

import json
import re
import shutil

import pytest

from kvoffload.cli import main
from kvoffload.replay.agentic import DEFAULT_STAGGER_S
from kvoffload.replay.traces import TraceError, load_trace

def conversation(requests, scope="local", block_size=4, **top):
    return {"id": "c", "block_size": block_size, "hash_id_scope": scope, "requests": requests, **top}


def req(t, ids, extra_tokens=0, bs=4, out=2, **kw):
    """A request whose hash_ids cover its full blocks only (floor), plus extra_tokens of tail."""
    return {"t": t, "type": "n", "in": len(ids) * bs + extra_tokens, "out": out, "hash_ids": ids, **kw}


def write(path, doc):
    path.write_text(json.dumps(doc))
    return path


def test_real_file_loads_with_floor_blocks(agentic_dir):
    f = agentic_dir / "trace_0303.json"
    doc = json.loads(f.read_text())
    tr = load_trace(f)
    assert tr.block_size == 64 and len(tr.requests) == len(doc["requests"])
    for r, d in zip(tr.requests, doc["requests"]):
        assert r.prompt_tokens == d["in"] and r.output_tokens == d["out"]
        assert len(r.block_hashes) == d["in"] // 64  # full blocks only: the file's own convention
        assert r.arrival_ms == d["t"] * 1000.0  # one conversation: no stagger offset
    # consecutive turns re-read the growing context: each request starts with (nearly) all of the
    # previous one's blocks, so the context outgrows any cache smaller than a conversation
    for a, b in zip(tr.requests, tr.requests[1:6]):
        a, b = a.block_hashes, b.block_hashes
        assert len(b) > len(a) and b[:len(a) - 1] == a[:-1]
    # every hashed block is full, so the tail tokens are what the prefix cache cannot hold
    r = tr.requests[0]
    assert all(tr.block_tokens(r, i) == 64 for i in range(len(r.block_hashes)))


def test_directory_loads_every_conversation_staggered(agentic_dir):
    tr = load_trace(agentic_dir)
    files = sorted(agentic_dir.glob("*.json"))
    total = sum(len(json.loads(f.read_text())["requests"]) for f in files)
    assert len(tr.requests) == total
    arrivals = [r.arrival_ms for r in tr.requests]
    assert arrivals == sorted(arrivals)
    firsts = {}
    for r in tr.requests:
        firsts.setdefault(r.req_id.split(":")[0], r.arrival_ms)
    # each conversation's first request is at t=0 of its own clock
    assert [firsts[f.stem] for f in files] == [i * DEFAULT_STAGGER_S * 1000 for i in range(len(files))]


def test_floor_and_ceil_block_counts_load_and_others_are_named(tmp_path):
    f = write(tmp_path / "a.json", conversation([req(0, [1, 2], extra_tokens=3),  # floor
                                                 req(1, [1, 2, 3], extra_tokens=-1)]))  # ceil: partial tail
    tr = load_trace(f)
    assert [len(r.block_hashes) for r in tr.requests] == [2, 3]
    assert tr.block_tokens(tr.requests[1], 2) == 3
    write(f, conversation([req(0, [1, 2], extra_tokens=8)]))  # 4 blocks of tokens, 2 ids
    with pytest.raises(TraceError, match=r"a.json: requests\[0\]: hash_ids has 2 entries but in=16 needs "
                                         r"floor\(16/4\)=4"):
        load_trace(f)


def test_floor_blocks_load_in_mooncake_format(tmp_path):
    """A converted file keeps kv-cache-tester's floor count: it must load."""
    p = tmp_path / "m.jsonl"
    p.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2]}) + "\n")
    tr = load_trace(p, block_size=4)
    assert len(tr.requests[0].block_hashes) == 2 and tr.requests[0].prompt_tokens == 10
    p.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n")
    with pytest.raises(TraceError, match=r"m.jsonl:1: hash_ids has 1 entries"):
        load_trace(p, block_size=4)


def test_local_id_scopes_are_kept_apart_per_file(tmp_path):
    write(tmp_path / "a.json", conversation([req(0, [1, 2, 3])]))
    write(tmp_path / "b.json", conversation([req(0, [1, 2, 3])]))
    tr = load_trace(tmp_path)
    a, b = (r.block_hashes for r in tr.requests)
    assert not set(a) & set(b)  # same ids, different files: different blocks
    assert tr.num_unique_blocks() == 6
    # "global" scope: the ids are shared across files, so the blocks are the same
    write(tmp_path / "a.json", conversation([req(0, [1, 2, 3])], scope="global"))
    write(tmp_path / "b.json", conversation([req(0, [1, 2, 3])], scope="global"))
    tr = load_trace(tmp_path)
    assert tr.requests[0].block_hashes == tr.requests[1].block_hashes


def test_subagent_requests_are_requests_timed_from_the_parent(tmp_path):
    doc = conversation([
        req(0, [1, 2]),
        {"t": 10, "type": "subagent", "requests": [
            req(0, [50, 51]),
            req(2.5, [50, 51, 52]),
            {"t": 4, "type": "subagent", "requests": [req(1, [70])]},  # a sub-agent's own sub-agent
        ]},
        req(20, [1, 2, 3]),
    ])
    tr = load_trace(write(tmp_path / "p.json", doc), stagger_s=0)
    got = [(r.arrival_ms, len(r.block_hashes), r.session) for r in tr.requests]
    assert got == [(0.0, 2, "p"), (10000.0, 2, "p/sa1"), (12500.0, 3, "p/sa1"), (15000.0, 1, "p/sa2"),
                   (20000.0, 3, "p")]
    main_ctx, sa1, sa2 = tr.requests[0].block_hashes, tr.requests[2].block_hashes, tr.requests[3].block_hashes
    assert sa1[:2] == tr.requests[1].block_hashes  # a sub-agent's own context grows as the parent's does
    assert not set(sa1) & set(main_ctx) and not set(sa2) & set(sa1)
    assert len({r.req_id for r in tr.requests}) == 5


def test_stagger_shifts_conversation_starts_and_interleaving(tmp_path):
    write(tmp_path / "a.json", conversation([req(0, [1]), req(30, [1, 2]), req(90, [1, 2, 3])]))
    write(tmp_path / "b.json", conversation([req(0, [1]), req(30, [1, 2])]))

    def order(stagger):
        tr = load_trace(tmp_path, stagger_s=stagger)
        return [(r.req_id, r.arrival_ms) for r in tr.requests]

    assert order(None) == order(DEFAULT_STAGGER_S)
    assert order(60) == [("a:0", 0.0), ("a:1", 30000.0), ("b:0", 60000.0), ("a:2", 90000.0),
                         ("b:1", 90000.0)]
    assert order(0) == [("a:0", 0.0), ("b:0", 0.0), ("a:1", 30000.0), ("b:1", 30000.0), ("a:2", 90000.0)]
    assert order(200) == [("a:0", 0.0), ("a:1", 30000.0), ("a:2", 90000.0), ("b:0", 200000.0),
                          ("b:1", 230000.0)]
    with pytest.raises(TraceError, match="stagger must be a finite number"):
        load_trace(tmp_path, stagger_s=-1)
    with pytest.raises(TraceError, match=r"b.json: requests\[0\]: arrival time overflows"):
        load_trace(tmp_path, stagger_s=1e306)  # finite, but times 1000 ms it is not


def test_directory_replays_end_to_end_with_byte_checks(agentic_dir, tmp_path, capsys):
    d = tmp_path / "agentic"
    d.mkdir()
    for name in ("trace_0304.json", "trace_0306.json", "trace_0325.json"):  # three small conversations
        shutil.copy(agentic_dir / name, d / name)
    js = tmp_path / "r.json"
    rc = main(["replay", str(d), "--cpu-blocks", "100%", "--stagger", "30", "--oracle", "--order", "legacy", "--verify", "all",
               "--no-progress", "--json", str(js)])
    assert rc == 0
    assert "all bytes match" in capsys.readouterr().out
    s = json.loads(js.read_text())["summary"]
    tr = load_trace(d, stagger_s=30)
    assert s["requests"] == len(tr.requests) == 5 + 6 + 7
    assert s["verify_failures"] == 0 and s["verified_blocks"] > 0
    # every block fits: the legacy-order replay is the offline LRU, and reuse within the conversations shows
    assert s["offload_prefix_hit_rate"] == s["oracle:lru"] == s["oracle:belady"] > 0.5
    assert s["tokens_from_gpu_cache"] + s["tokens_from_offload"] + s["tokens_recomputed"] == s["prompt_tokens"]


def test_stagger_option_sets_the_interleaving(tmp_path, capsys):
    """One cached block: conversation a's second turn hits only if b's first
    request does not come between a's two (and evict a's block)."""
    write(tmp_path / "a.json", conversation([req(0, [1]), req(30, [1, 2])]))
    write(tmp_path / "b.json", conversation([req(0, [7])]))
    js = tmp_path / "out" / "r.json"
    js.parent.mkdir()

    def hit_rate(stagger):
        assert main(["replay", str(tmp_path), "--stagger", stagger, "--cpu-blocks", "1", "--order", "legacy",
                     "--no-progress", "--json", str(js)]) == 0
        return json.loads(js.read_text())["summary"]["offload_prefix_hit_rate"]

    assert hit_rate("0") == 0.0  # a:0, b:0, a:1
    assert hit_rate("100") == 0.25  # a:0, a:1 (1 of its 2 blocks), b:0
    assert main(["replay", str(tmp_path), "--stagger", "-5", "--no-progress"]) == 2
    assert "--stagger must be a finite number >= 0, got -5.0" in capsys.readouterr().err


@pytest.mark.parametrize("content, msg", [
    ("{oops", r"bad.json: invalid JSON: Expecting property name enclosed in double quotes \(line 1 column 2\)"),
    ('{"requests": 5}', r"bad.json: requests must be a list of requests, got int"),
    ('{"requests": [{"t": 0, "type": "n", "in": 8, "out": 1, "hash_ids": [1, "x"]}]}',
     r"bad.json: requests\[0\]: hash_ids must hold integers"),
    *[('{"requests": [{"t": 0, "type": "n", "in": 8, "out": 1, "hash_ids": [1, %s]}]}' % v,
       r"bad.json: requests\[0\]: hash_ids must hold integers in \[0, 2\*\*64\), got " + re.escape(shown))
      for v, shown in (("-1", "-1"), (str(2**64), str(2**64)), ("1.5", "1.5"), ("true", "True"))],
    ('{"requests": [{"type": "n", "in": 8, "out": 1, "hash_ids": [1, 2]}]}',
     r"bad.json:requests\[0\]: missing field 't'"),
    ('{"requests": [{"t": 0, "type": "subagent", "requests": [{"t": 1, "in": -1}]}]}',
     r"bad.json:requests\[0\].requests\[0\]: in must be a non-negative integer"),
    ('{"requests": [{"t": NaN, "in": 8, "out": 1, "hash_ids": [1, 2]}]}', r"bad.json:requests\[0\]: t must be"),
    ('{"block_size": 0, "requests": []}', r"bad.json: block_size must be a positive integer"),
    ('{"requests": []}', r"bad.json: no requests in trace"),
])
def test_malformed_agentic_json_is_one_line_naming_the_file(tmp_path, capsys, content, msg):
    d = tmp_path / "dir"
    d.mkdir()
    write(d / "good.json", conversation([req(0, [1, 2])]))
    (d / "bad.json").write_text(content)
    with pytest.raises(TraceError, match=msg):
        load_trace(d, fmt="agentic")
    assert main(["replay", str(d), "--format", "agentic", "--block-size", "4", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvoffload replay: ") and "bad.json" in err


def test_directory_without_traces_and_mixed_block_sizes(tmp_path, capsys):
    assert main(["replay", str(tmp_path), "--no-progress"]) == 2
    assert "no *.json agentic traces in this directory" in capsys.readouterr().err
    write(tmp_path / "a.json", conversation([req(0, [1])], block_size=4))
    write(tmp_path / "b.json", conversation([req(0, [1], bs=8)], block_size=8))
    with pytest.raises(TraceError, match="b.json: block_size 8 differs from 4"):
        load_trace(tmp_path)
