"""What the in-process SGLang suites share: the backend registered on the mock, and a
bootstrap server per test."""

import pytest

MOCK = {"backend": "mock", "groups": [{"nics": ["mock0"]}], "timeouts": {"transfer_ms": 2000}}


@pytest.fixture(scope="module")
def registered():
    """``xfer.sglang`` registered with SGLang, its engines on the mock."""
    xs = pytest.importorskip("xfer.sglang")
    xs.register(config=MOCK)


@pytest.fixture
def bootstrap():
    """A prefill bootstrap server on loopback; its ``host:port``."""
    xs = pytest.importorskip("xfer.sglang")
    server = xs.XferKVBootstrapServer("127.0.0.1", 0)
    yield server.url.removeprefix("xfer://")
    server.close()
