"""``xfer.ep``: MoE expert-parallel dispatch and combine on xfer's primitives.

The plan and the protocol are the Rust crate ``xfer-ep-plan`` (through
``xfer._xfer.EpStep``); this package carries them out on a ``TransferEngine``:

- ``EpConfig``, ``EpGroup`` (``layout.py``, ``group.py``): numpy on host memory —
  ``dispatch`` / ``combine`` and the split stages ``dispatch_send`` / ``dispatch_recv`` /
  ``combine_send`` / ``combine_recv``, DeepEP's low-latency layout or a flat expert-major one,
  combine reduced in fp32 with the weights, ``query_active_mask`` / ``clean``;
- ``xfer.ep.tensors``: the same on torch tensors;
- ``xfer.ep.deep_ep``: DeepEP's low-latency ``Buffer``, for vLLM and SGLang (see
  ``docs/moe.md`` for how to select it);
- ``xfer.ep.rendezvous``: ``EpRendezvous``, forming a group through xfer's rendezvous, and
  re-forming it at a clean with a restarted rank;
- ``xfer.ep.oracle``: the communication-free oracle the tests and the benchmark use.
"""

from .group import EpError, EpGroup, Handle
from .layout import EpConfig
from .rendezvous import EpRendezvous

__all__ = ["EpConfig", "EpGroup", "EpError", "EpRendezvous", "Handle"]
