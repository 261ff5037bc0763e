"""The old path of xfer.kv.sglang_layout: the same module object, so imports and patches through either
name reach one module."""

import sys as _sys

from .kv import sglang_layout as _module

_sys.modules[__name__] = _module
