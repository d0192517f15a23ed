"""rediss:// against a real TLS redis-server (certificates made here with openssl)."""

from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from kvoffload.abstractions import LookupResult
from kvoffload.config import ConfigError
from kvoffload.tiers.redis.server import LocalServer, free_port
from remote_helpers import fill, keys_for, load, lookup, make_tier, store

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("openssl missing")
    d = tmp_path_factory.mktemp("tls")

    def ssl(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=kvoffload-test-ca")
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "srv.key", "-out", "srv.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    ssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "srv.crt", "-days", "2", "-extfile", "ext.cnf")
    tls_port = free_port()
    srv = LocalServer(extra_args=("--tls-port", str(tls_port), "--tls-cert-file", str(d / "srv.crt"),
                                  "--tls-key-file", str(d / "srv.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
                                  "--tls-auth-clients", "no"))
    try:
        srv.start()
    except RuntimeError as e:
        srv.close()
        pytest.skip(f"this redis-server has no TLS: {e}")
    yield f"rediss://127.0.0.1:{tls_port}/0", str(d / "ca.crt")
    srv.close()


def test_tls_round_trip(tls_server, prefix):
    url, ca = tls_server
    tier, m, w, pool = make_tier(url, prefix, num_chunks=8, chunk_bytes=256 << 10, tls_ca_certs=ca)
    try:
        assert tier.reachable_at_start
        keys = keys_for(4, seed=60)
        fill(pool, range(4), seed=60)
        assert store(m, w, keys, [0, 1, 2, 3])
        assert lookup(m, keys[3]) is LookupResult.HIT
        assert load(m, w, keys, [4, 5, 6, 7])
        assert np.array_equal(pool.array[:4], pool.array[4:])
    finally:
        tier.shutdown()


@pytest.mark.parametrize("host, give_ca", [
    ("127.0.0.1", False),  # no CA given: the server's certificate is signed by an unknown CA
    ("localhost", True),  # right CA, but the certificate is for 127.0.0.1 only
])
def test_a_certificate_that_does_not_verify_is_a_startup_error(tls_server, prefix, host, give_ca):
    """It would never verify later either: one ConfigError naming the keys,
    not a warning and misses for the life of the process."""
    url, ca = tls_server
    url = url.replace("127.0.0.1", host)
    with pytest.raises(ConfigError, match=r"does not verify.*remote\.tls_ca_certs.*remote\.tls_verify") as e:
        make_tier(url, prefix, **({"tls_ca_certs": ca} if give_ca else {}))
    assert "\n" not in str(e.value)


def test_an_unreachable_tls_server_is_an_outage_not_an_error(tls_server, prefix):
    _url, ca = tls_server
    tier, m, w, pool = make_tier(f"rediss://127.0.0.1:{free_port()}/0", prefix, tls_ca_certs=ca,
                                 connect_timeout_s=0.5, socket_timeout_s=0.5)
    try:
        assert not tier.reachable_at_start
        assert not store(m, w, keys_for(1, seed=61), [0])
    finally:
        tier.shutdown()


@pytest.mark.parametrize("ca_file, why", [
    ("missing.pem", "cannot read it"),
    ("not-a-cert.pem", "not a PEM certificate bundle"),
])
def test_a_bad_ca_file_is_a_startup_error(tls_server, prefix, tmp_path, ca_file, why):
    url, _ca = tls_server
    (tmp_path / "not-a-cert.pem").write_text("hello\n")
    path = str(tmp_path / ca_file)
    with pytest.raises(ConfigError, match=rf"remote\.tls_ca_certs '{path}': {why}"):
        make_tier(url, prefix, tls_ca_certs=path)
