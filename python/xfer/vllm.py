"""``xfer.vllm``, the path vLLM loads by ``kv_connector_module_path``: the module
``xfer.kv.vllm`` itself (the same object), so imports and patches through either name reach one
module."""

import sys as _sys

from .kv import vllm as _module

_sys.modules[__name__] = _module
