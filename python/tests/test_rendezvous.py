"""Peers find each other by name through the rendezvous (the embedded service here; the
etcd half of the suite runs in Rust, `rendezvous/tests/suite.rs`)."""

import numpy as np
import pytest

import xfer
from conftest import MOCK


def test_publish_lookup_write_and_unpublish():
    server = xfer.Server()
    try:
        rdv = xfer.Rendezvous(server.url)
        with xfer.TransferEngine(MOCK) as decode, xfer.TransferEngine(MOCK) as prefill:
            cache = np.zeros(1 << 16, dtype=np.uint8)
            region = decode.reg_mr(cache)
            pub = rdv.publish("decode-0", decode.main_address, {"kv-cache": region}, ttl=3)
            peer = xfer.Rendezvous(server.url).lookup("decode-0", timeout=10)
            assert peer["name"] == "decode-0" and peer["addr"] == decode.main_address
            assert peer["incarnation"] == pub.incarnation
            src = prefill.reg_mr(np.full(1 << 16, 7, dtype=np.uint8), access="local")
            prefill.submit_single_write(src, peer["regions"]["kv-cache"], imm=1).wait(10)
            decode.expect_imm_count(1, decode.expected_arrivals(1 << 16)).wait(10)
            assert (cache == 7).all()
            assert [r["name"] for r in rdv.list()] == ["decode-0"]
            pub.unpublish()
            with pytest.raises(xfer.TimeoutError):
                rdv.lookup("decode-0", timeout=0.1)
    finally:
        server.close()


def test_bad_urls_names_and_unreachable_services():
    with pytest.raises(xfer.InvalidArgumentError):
        xfer.Rendezvous("http://127.0.0.1:1")
    server = xfer.Server()
    url = server.url
    rdv = xfer.Rendezvous(url)
    with pytest.raises(xfer.InvalidArgumentError, match="name"):
        rdv.lookup("no/slashes", timeout=0.1)
    server.close()
    with pytest.raises(xfer.RendezvousError, match="not reachable within"):
        xfer.Rendezvous(url, connect_timeout=0.3)


def test_a_client_started_before_the_service_waits_for_it():
    """Issue 23: processes start in any order; the client rides out a service that comes
    up two seconds after it."""
    import socket
    import threading

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    late = []
    starter = threading.Timer(2.0, lambda: late.append(xfer.Server(f"127.0.0.1:{port}")))
    starter.start()
    try:
        rdv = xfer.Rendezvous(f"xfer://127.0.0.1:{port}", connect_timeout=60)
        with xfer.TransferEngine(MOCK) as engine:
            with rdv.publish("early", engine.main_address, ttl=3):
                assert rdv.lookup("early", timeout=10)["addr"] == engine.main_address
    finally:
        starter.join()
        for server in late:
            server.close()


def test_the_service_and_its_clients_share_a_secret(tmp_path):
    """Issue 25 §1: with a secret file, only clients holding the same secret get in."""
    secret, other = tmp_path / "secret", tmp_path / "other"
    secret.write_bytes(b"\x01" * 32)
    other.write_bytes(b"\x02" * 32)
    for f in (secret, other):
        f.chmod(0o600)
    server = xfer.Server(secret_file=secret)
    try:
        rdv = xfer.Rendezvous(server.url, secret_file=secret, connect_timeout=5)
        pub = rdv.publish("p-0", b"\x01\x06" + b"\x07" * 6, ttl=3)
        assert [r["name"] for r in rdv.list()] == ["p-0"]
        for wrong in (other, None):
            with pytest.raises(xfer.RendezvousError, match="authentication failed"):
                xfer.Rendezvous(server.url, secret_file=wrong, connect_timeout=5)
        # A second publisher of a live name is refused once its wait runs out.
        with pytest.raises(xfer.RendezvousError, match="another live publisher"):
            xfer.Rendezvous(server.url, secret_file=secret, connect_timeout=0.3).publish(
                "p-0", b"\x01\x06" + b"\x08" * 6, ttl=3)
        pub.unpublish()
    finally:
        server.close()
    # A secret short enough to guess from one recorded proof is refused, naming the file.
    short = tmp_path / "short"
    short.write_bytes(b"cluster secret")
    short.chmod(0o600)
    with pytest.raises(xfer.RendezvousError, match=r"short: the secret is 14 bytes; it must be at least 16"):
        xfer.Server(secret_file=short)
    # Issue 42 §10: one other users may read is refused, naming its mode and the fix.
    secret.chmod(0o644)
    with pytest.raises(xfer.RendezvousError, match=r"mode is 644.*chmod 600"):
        xfer.Server(secret_file=secret)


def test_the_secret_file_variable_keys_the_engine_too(tmp_path, monkeypatch):
    """Issue 56: `$XFER_SECRET_FILE`, which keys the rendezvous, is the engine's secret too
    (the backend's handshake gets it), and a config naming another file is refused naming
    both."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"\x03" * 32)
    secret.chmod(0o600)
    monkeypatch.setenv("XFER_SECRET_FILE", str(secret))
    with xfer.TransferEngine(MOCK) as engine:
        assert str(engine.secret_file) == str(secret)
    other = dict(MOCK, security={"secret_file": str(tmp_path / "other")})
    with pytest.raises(xfer.ConfigError, match=r"other.*XFER_SECRET_FILE"):
        xfer.TransferEngine(other)
    monkeypatch.delenv("XFER_SECRET_FILE")
    with xfer.TransferEngine(MOCK) as engine:
        assert engine.secret_file is None


def test_etcd_security_keywords_reach_the_etcd_client(tmp_path):
    """Issue 56: the etcd TLS/auth keywords reach the client (here: a password without TLS
    is refused before anything is sent, naming why). Needs the package's `etcd` feature."""
    password = tmp_path / "password"
    password.write_text("pw\n")
    password.chmod(0o600)
    try:
        xfer.Rendezvous("etcd://127.0.0.1:9/x", connect_timeout=0.2, etcd_user="xfer",
                        etcd_password_file=password)
    except xfer.Error as e:
        if isinstance(e, xfer.NotAvailableError) and "no etcd client" in str(e):
            pytest.skip("this build has no etcd client (the package's `etcd` feature)")
        assert isinstance(e, xfer.RendezvousError), repr(e)
        assert "cleartext" in str(e) and "etcd_ca_file" in str(e), str(e)
    else:
        pytest.fail("a password without TLS was accepted")
