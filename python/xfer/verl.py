"""``xfer.verl``: the documented import path of ``xfer.weights.verl`` (the same module
object, so its state, its registrations and every name are the ones there)."""

import importlib as _importlib
import sys as _sys

_sys.modules[__name__] = _importlib.import_module("xfer.weights.verl")
