"""xfer's stand-in for DeepEP's ``deep_ep`` package, found only when this directory is put
first on ``PYTHONPATH`` on purpose (``python -m xfer.ep.deep_ep --path``). Everything is
``xfer.ep.deep_ep``."""

from xfer.ep.deep_ep import Buffer, Config, EventOverlap  # noqa: F401

__xfer__ = True
