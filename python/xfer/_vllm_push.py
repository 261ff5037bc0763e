"""The old path of xfer.kv.vllm_push: the same module object, so imports and patches through either
name reach one module."""

import sys as _sys

from .kv import vllm_push as _module

_sys.modules[__name__] = _module
