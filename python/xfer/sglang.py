"""``xfer.sglang``, whose ``register`` is SGLang's entry point: the module ``xfer.kv.sglang``
itself (the same object), so imports and patches through either name reach one module."""

import sys as _sys

from .kv import sglang as _module

_sys.modules[__name__] = _module
