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
    with pytest.raises(xfer.RendezvousError):
        xfer.Rendezvous(url)
