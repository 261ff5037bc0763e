"""RL weight sync: trainer ranks write a new version of the weights straight into the
inference ranks' registered memory, on a plan computed once from both sides' metadata; a
version is all-or-nothing across ranks (two phases: the coordinator alone commits).

The package's rooms — a pure core under thin adapters, one per framework:

- ``layout``: what a version moves (``TensorSpec``, ``Layout``) and the one decoder of a
  layout from the wire; ``plan``: the plan (Rust, ``xfer-weight-plan``) as numpy columns;
  ``protocol``: the control messages, their one decoder (sender, session, bounds), the inbox
  and the coordinator's decision — all pure, no engine, no framework.
- ``executor``: the protocol over an engine, its two ends in ``sender`` (``WeightSender``) and
  ``receiver`` (``WeightReceiver``).
- ``engines``: full-tensor sender and staged receiver for frameworks that load through their
  engine's own ``load_weights`` (``xfer.engine_weights``).
- ``slices``: which boxes of the checkpoint a rank's own loader takes (pure).
- adapters: ``vllm_engine`` (vLLM's weight-transfer API backend ``xfer``, each worker
  receiving only its slices; its worker engine in ``vllm_worker``, trainer engine in
  ``vllm_trainer``, shared wire contract in ``vllm_contract``), ``vllm`` (``xfer.vllm_weights``), ``sglang`` (``xfer.sglang_weights``),
  ``verl`` (``xfer.verl``: verl's checkpoint engine). Importing ``xfer.weights`` imports none
  of them, nor any framework.
"""

from .executor import VersionFailed, VersionInDoubt, WeightReceiver, WeightSender, _aligned, _bytes_of
from .layout import DTYPE_SIZES, Layout, LayoutError, PieceSpec, SliceSpec, TensorSpec
from .plan import Writes, plan

__all__ = [
    "TensorSpec",
    "Layout",
    "LayoutError",
    "Writes",
    "plan",
    "VersionFailed",
    "VersionInDoubt",
    "WeightSender",
    "WeightReceiver",
    "DTYPE_SIZES",
    "SliceSpec",
    "PieceSpec",
]
