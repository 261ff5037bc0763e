"""The old path of xfer.kv.pages: the same module object, so imports and patches through either
name reach one module."""

import sys as _sys

from .kv import pages as _module

_sys.modules[__name__] = _module
