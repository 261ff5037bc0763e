import os
import sys

import pytest
import xfer


@pytest.fixture
def engine():
    """An engine on the built-in mock (one NIC, in-order), closed after the test."""
    with xfer.TransferEngine(MOCK) as e:
        yield e


class _Dials(list):
    real = None


@pytest.fixture
def rendezvous_dials(monkeypatch):
    """``(url, options)`` of every ``xfer.Rendezvous`` made during the test: a recording
    wrapper, the real client then dials (what each component's clients are made with); its
    ``real`` makes a client unrecorded."""
    dialled = _Dials()
    real = dialled.real = xfer.Rendezvous

    def recording(url, **options):
        dialled.append((url, options))
        return real(url, **options)

    monkeypatch.setattr(xfer, "Rendezvous", recording)
    return dialled


def _lines_run(module, call):
    """How many lines of ``module`` ``call()`` executes (a loop's line counts once per pass):
    the work done, counted — never timed."""
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        lines += event == "line"
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == module.__file__ else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        call()
    finally:
        sys.settrace(previous)
    return lines


@pytest.fixture
def lines_run():
    """``lines_run(module, call)``: the lines of ``module`` that ``call()`` runs, for tests
    that bound the work a message costs (how it grows with what is held) without a clock."""
    return _lines_run


def _random_block_ids(rng, n):
    """``n`` random non-negative block ids as they travel (little-endian int32), made as
    bytes: no Python int per id, which tracemalloc would trace one by one."""
    payload = bytearray(rng.randbytes(4 * n))
    payload[3::4] = payload[3::4].translate(bytes(b & 0x7F for b in range(256)))
    return bytes(payload)


@pytest.fixture
def random_block_ids():
    """``random_block_ids(rng, n)``: a block-id payload of ``n`` random ids (a stranger's)."""
    return _random_block_ids


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


# NIXL 1.5.1's wheels (the vLLM suite's control) crash the process as it exits: the libnl-route
# they bundle faults in its ELF destructor (`rtnl_tc_unregister` from `_dl_fini`), after every
# test passed and pytest printed its summary (a bare `nixl_agent(..., backends=["UCX"])` in a
# three-line script does the same). Where NIXL was loaded, the run ends with pytest's own exit
# status before the C library's destructors run, once Python's own exit handlers are done.
_exit_status = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


def _skip_nixl_destructors():
    import sys

    if _exit_status is not None and any(m in sys.modules for m in ("nixl_cu12", "nixl_cu13")):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)


import atexit  # noqa: E402

atexit.register(_skip_nixl_destructors)
