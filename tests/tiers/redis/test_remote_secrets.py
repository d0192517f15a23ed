"""No password or key reaches a report, a log line, an exception or a repr:
a real replay against a real password-protected redis-server, every output
grepped for the secret."""

from __future__ import annotations

import json
import logging
import uuid

import pytest

from kvoffload.cli import main
from kvoffload.config import ConfigError
from kvoffload.redact import redact, redact_text, redact_url
from kvoffload.tiers.base import Namespace
from kvoffload.tiers.redis import RemoteConfig, RemoteTier
from kvoffload.tiers.redis.server import LocalServer

pytestmark = pytest.mark.redis


def _replay(url: str, tmp_path, tag: str) -> tuple[int, list[str]]:
    js, md = tmp_path / f"{tag}.json", tmp_path / f"{tag}.md"
    rc = main(["replay", "--sessions", "4", "--remote-url", url, "--sync-tiers", "--no-progress",
               "--json", str(js), "--markdown", str(md)])
    return rc, [p.read_text() for p in (js, md) if p.exists()]


def test_replay_with_a_password_writes_it_nowhere(redis_binary, tmp_path, capsys, caplog):
    pw, bad = f"pw-{uuid.uuid4().hex}", f"bad-{uuid.uuid4().hex}"
    caplog.set_level(logging.DEBUG)
    with LocalServer(password=pw) as srv:
        rc, files = _replay(srv.url, tmp_path, "good")
        out = capsys.readouterr()
        assert rc == 0, out.err
        report = json.loads(files[0])
        remote = [t for name, t in report["summary"]["tiers"].items() if "remote" in name or "redis" in name]
        assert remote and remote[0].get("stored_blocks", 0) > 0  # the remote tier really ran
        assert "***" in files[0]  # the URL is there, redacted
        outputs = [out.out, out.err, caplog.text, *files]

        rc, files = _replay(f"redis://:{bad}@127.0.0.1:{srv.port}/0", tmp_path, "bad")
        out = capsys.readouterr()
        assert rc == 2 and "authentication" in out.err and "***" in out.err
        outputs += [out.out, out.err, caplog.text, *files]

        ns = Namespace(model="tiny", dtype="bf16", layout="canon", block_size=16, chunk_bytes=4096)
        with pytest.raises(ConfigError) as e:
            RemoteTier({"url": f"redis://:{bad}@127.0.0.1:{srv.port}/0"}, ns)
        outputs += [str(e.value), repr(e.value)]
        with pytest.raises(ConfigError) as e:
            RemoteTier({"url": f"redis://127.0.0.1:{srv.port}/0", "password": bad}, ns)
        outputs += [str(e.value), repr(e.value)]

        cfg = RemoteConfig(url=srv.url, password=pw)
        outputs += [repr(cfg), str(cfg), cfg.redacted_url, repr(RemoteConfig(url=f"unix:///x.sock?password={pw}"))]
    for text in outputs:
        assert pw not in text and bad not in text


def test_redact_helpers():
    assert redact_url("redis://user:s3c@h:1/0") == "redis://user:***@h:1/0"
    assert redact_url("unix:///run/r.sock?password=s3c&db=1") == "unix:///run/r.sock?password=***&db=1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert "s3c" not in redact_text("cannot reach rediss://:s3c@h:1 now")
    assert redact_text("at 'unix:///r.sock?db=1&password=s3c' now") == "at 'unix:///r.sock?db=1&password=***' now"
    assert redact({"remote_url": "redis://:s3c@h", "password": "s3c", "mac_key_file": "/k", "n": [1]}) == {
        "remote_url": "redis://:***@h", "password": "***", "mac_key_file": "/k", "n": [1]}


def test_misshapen_tier_configs_do_not_echo_secrets():
    from kvoffload.config import OffloadingConfig
    from kvoffload.tiering import TieredOffloadingSpec

    for tiers in ({"type": "redis", "url": "redis://:s3c-pw@h:1/0", "password": "s3c-pw"},
                  ["redis://:s3c-pw@h:1/0"]):
        with pytest.raises(ConfigError, match="secondary_tiers") as e:
            TieredOffloadingSpec(OffloadingConfig.from_dict({"groups": [16], "extra_config": {
                "num_cpu_chunks": 4, "secondary_tiers": tiers}}))
        assert "s3c-pw" not in str(e.value) and "***" in str(e.value)


def test_password_from_env_or_file_keeps_it_out_of_configs(redis_binary, tmp_path, monkeypatch, prefix):
    from remote_helpers import keys_for, load, make_tier, store

    pw = f"pw-{uuid.uuid4().hex}"
    pw_file = tmp_path / "redis.pw"
    pw_file.write_text(pw + "\n")
    monkeypatch.setenv("KVOFF_TEST_REDIS_PW", pw)
    monkeypatch.delenv("KVOFF_TEST_UNSET", raising=False)
    with LocalServer(password=pw) as srv:
        url = f"redis://127.0.0.1:{srv.port}/0"
        for conf in ({"password_env": "KVOFF_TEST_REDIS_PW"}, {"password_file": str(pw_file)}):
            tier, m, w, pool = make_tier(url, prefix, **conf)
            try:
                assert store(m, w, keys_for(1, seed=70), [0]) and load(m, w, keys_for(1, seed=70), [1])
                assert pw not in repr(tier.config)
            finally:
                tier.shutdown()
        for conf, msg in (({"password_env": "KVOFF_TEST_UNSET"}, "not set"),
                          ({"password_file": str(tmp_path / "missing")}, "password_file"),
                          ({"password": "x", "password_env": "KVOFF_TEST_REDIS_PW"}, "at most one")):
            with pytest.raises(ConfigError, match=msg) as e:
                make_tier(url, prefix, **conf)
            assert pw not in str(e.value)
