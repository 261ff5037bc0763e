"""xfer: point-to-point RDMA transfers for LLM systems.

One portable model — reliable but unordered delivery; completion on the receiver counted by
immediates — over verbs (ConnectX, soft-RoCE), libfabric (AWS EFA, shm, tcp) and a built-in
mock. See ``help(xfer.TransferEngine)``::

    import numpy as np, xfer
    with xfer.TransferEngine() as engine:          # the mock, or $XFER_CONFIG
        src = engine.reg_mr(np.arange(4096, dtype=np.uint8), access="local")
        dst = engine.reg_mr(np.zeros(4096, dtype=np.uint8))
        engine.submit_single_write(src, dst.desc, imm=7).wait(5)
        engine.expect_imm_count(7, engine.expected_arrivals(4096)).wait(5)

Backends other than the mock are plugins: the package's ``plugins`` folder (filled by
``cargo xtask python``) is searched after ``$XFER_PLUGIN_PATH``, and a plugin is loaded
only when a config selects it, so ``import xfer`` needs neither libfabric nor libibverbs.
"""

import os as _os

_PLUGINS = _os.path.join(_os.path.dirname(__file__), "plugins")
if _os.path.isdir(_PLUGINS):
    _path = _os.environ.get("XFER_PLUGIN_PATH")
    _os.environ["XFER_PLUGIN_PATH"] = _PLUGINS if not _path else _path + _os.pathsep + _PLUGINS

from ._errors import *  # noqa: E402,F401,F403
from ._errors import __all__ as _error_names  # noqa: E402
from ._xfer import (  # noqa: E402
    GpuCounter,
    MemoryRegion,
    MrDesc,
    NetAddr,
    PeerGroup,
    Publication,
    Rendezvous,
    Server,
    Transfer,
    TransferEngine,
    Watcher,
    __version__,
    builtin_backends,
    callback_errors,
    expected_arrivals,
)

__all__ = [
    "TransferEngine",
    "MemoryRegion",
    "MrDesc",
    "NetAddr",
    "PeerGroup",
    "Rendezvous",
    "Publication",
    "Server",
    "Transfer",
    "Watcher",
    "GpuCounter",
    "expected_arrivals",
    "callback_errors",
    "builtin_backends",
    "__version__",
    *_error_names,
]
