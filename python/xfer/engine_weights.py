"""``xfer.engine_weights``: the documented import path of ``xfer.weights.engines`` (the same module
object, so its state, its registrations and every name are the ones there)."""

import importlib as _importlib
import sys as _sys

_sys.modules[__name__] = _importlib.import_module("xfer.weights.engines")
