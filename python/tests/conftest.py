import os
import pytest
import xfer


@pytest.fixture
def engine():
    """An engine on the built-in mock (one NIC, in-order), closed after the test."""
    with xfer.TransferEngine(MOCK) as e:
        yield e


# The mock with SRD-like reordering and two NICs: completions in any order, writes striped.
MOCK = {
    "backend": "mock",
    "groups": [{"nics": ["mock0", "mock1"]}],
    "timeouts": {"expect_ms": 5000, "transfer_ms": 5000},
    "backends": {"mock": {"seed": 7, "reorder": True}},
}


def plugin_available(name):
    """Whether the package (or $XFER_PLUGIN_PATH) has the backend plugin `name`."""
    for d in os.environ.get("XFER_PLUGIN_PATH", "").split(os.pathsep):
        if d and os.path.exists(os.path.join(d, f"libbackend_{name}.so")):
            return True
    return False
