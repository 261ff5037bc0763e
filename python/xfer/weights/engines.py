"""Weight sync for RL frameworks that drive the inference engines themselves (vLLM's
``collective_rpc``, SGLang's ``update_weights_from_tensor``): the pieces both engine
integrations (``xfer.vllm_weights``, ``xfer.sglang_weights``) and the trainer side share.

The contract is verl's: every trainer rank holds every tensor whole under its checkpoint
(Hugging Face) name, and every inference worker receives every tensor whole, then hands them
to its engine's own loader (``model.load_weights``), which fuses ``q/k/v`` into ``qkv_proj``,
``gate/up`` into ``gate_up_proj`` and takes this worker's tensor-parallel slice. The plan
(``xfer.weights``) splits the sending evenly over the trainer ranks.

A version is received into registered staging memory, not into the model: ``receive``
returns only once every byte of the version landed and every rank succeeded, so a failed
version (a trainer rank killed mid-way, a timeout) never reaches the model's parameters; the
engine keeps serving the previous version and the next version is received whole.

Nothing here imports vLLM or SGLang: a trainer process needs only torch and xfer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import os

import xfer
from xfer import weights as W
from xfer.rendezvous_security import RendezvousSecurity

__all__ = ["FullTensorSender", "StagedReceiver", "engine_config", "full_tensor_specs"]


def engine_config(config: str | dict[str, Any] | None, who: str) -> str | dict[str, Any]:
    """The xfer engine config ``who`` builds its engine from: ``config`` (a TOML path or a
    dict), else ``$XFER_CONFIG``; with neither, refused by name. ``xfer.TransferEngine(None)``
    would quietly build the in-process mock backend, which "works" on one machine and moves
    nothing between hosts; the mock is ``{"backend": "mock"}``, given explicitly."""
    if config is not None:
        return config
    env = os.environ.get("XFER_CONFIG")
    if env:
        return env
    raise ValueError(
        f"{who}: no xfer config (pass config=, a TOML path or a dict, or set $XFER_CONFIG): say which "
        "backend; the mock is {'backend': 'mock'}, given explicitly")


def full_tensor_specs(named_tensors: Iterable[tuple[str, Any]]) -> list[W.TensorSpec]:
    """The specs of full tensors (name, shape, dtype name as the receivers get it)."""
    return [
        W.TensorSpec(name, tuple(int(d) for d in t.shape), str(t.dtype).removeprefix("torch."))
        for name, t in named_tensors
    ]


class _Member:
    """An xfer engine and a rendezvous client, closed together."""

    def __init__(self, rendezvous: str, config: str | dict[str, Any] | None, who: str) -> None:
        config = engine_config(config, who)
        # The operator's settings (the secret, etcd's TLS and user) from the engine config or
        # the environment, refused before anything opens if they cannot work.
        security = RendezvousSecurity.of(config, who="xfer weight sync")
        self.engine = xfer.TransferEngine(config)
        try:
            self.rendezvous: xfer.Rendezvous | None = security.connect(rendezvous)
        except BaseException:
            self.engine.close()
            raise

    def _close_engine(self) -> None:
        """Closes the engine and lets the rendezvous client go: its connection closes with
        the last reference (the client has no ``close``), so a member closed but still
        referenced — a worker's attribute, a module's global — holds none."""
        self.rendezvous = None
        if not self.engine.closed:
            self.engine.close()

    def _leave_and_close(self, attr: str) -> None:
        """Leaves the group through the executor member in attribute ``attr`` (if any), then
        closes the engine even if leaving fails; idempotent."""
        member = getattr(self, attr)
        setattr(self, attr, None)
        try:
            if member is not None:
                member.close()
        finally:
            # Its lookups end even when leaving failed: their thread holds the member.
            stop = getattr(member, "stop_forming", None)
            if stop is not None:
                stop()
            del member, stop  # its rendezvous reference, which a raised error's frame would keep
            self._close_engine()


class FullTensorSender(_Member):
    """A trainer rank's side: sends full, checkpoint-named tensors to every inference worker.

    ``rendezvous``: ``xfer://host:port`` of an ``xfer.Server`` every rank reaches (the
    framework runs one, e.g. on trainer rank 0's host); ``group``: a name the version's
    members share; ``budget_bytes``: staging memory (``None``: every tensor staged at once;
    else two buckets of half of it, the largest tensor must fit in one)."""

    def __init__(
        self,
        *,
        rendezvous: str,
        group: str,
        receivers: int,
        rank: int = 0,
        senders: int = 1,
        config: str | dict[str, Any] | None = None,
        timeout: float = 300.0,
        grace: float | None = None,
        budget_bytes: int | None = None,
    ) -> None:
        super().__init__(rendezvous, config, "FullTensorSender")
        try:
            self.sender: W.WeightSender | None = W.WeightSender(
                self.engine, self.rendezvous, group, rank, senders, receivers,
                timeout=timeout, grace=grace, budget_bytes=budget_bytes,
            )
        except BaseException:
            self._close_engine()
            raise

    def send(
        self,
        version: int,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        transform: Callable[[str, Any], Any] | None = None,
    ) -> W.Layout:
        """Sends ``version`` (every tensor, CPU torch tensors or numpy arrays; ``transform``
        as ``WeightSender.send`` takes it). Returns the layout once every rank succeeded;
        raises ``xfer.weights.VersionFailed`` otherwise. Versions must increase."""
        named = list(named_tensors)
        names = [n for n, _ in named]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"tensor names given more than once: {dup}")
        s = self.sender
        if s is None:
            raise RuntimeError("FullTensorSender.send after close")
        layout = W.Layout.replicated(full_tensor_specs(named), s.senders, s.receivers)
        # Layout.replicated numbers the shards rank-major: this rank's tensor i is shard
        # rank * len(tensors) + i.
        first = s.rank * len(named)
        s.send(version, layout, {first + i: t for i, (_, t) in enumerate(named)}, transform=transform)
        return layout

    def close(self) -> None:
        """Leaves the group and closes the engine, even if leaving fails (idempotent)."""
        self._leave_and_close("sender")


class StagedReceiver(_Member):
    """An inference worker's side: receives each version whole into registered staging and
    returns its tensors (torch views of the staging buffer, valid until the next
    ``receive``) for the engine's own loader."""

    def __init__(
        self,
        *,
        rendezvous: str,
        group: str,
        rank: int,
        receivers: int,
        senders: int = 1,
        config: str | dict[str, Any] | None = None,
        timeout: float = 300.0,
        grace: float | None = None,
        who: str = "StagedReceiver",
    ) -> None:
        super().__init__(rendezvous, config, who)
        try:
            self.receiver: W.WeightReceiver | None = W.WeightReceiver(
                self.engine, self.rendezvous, group, rank, senders, receivers, timeout=timeout, grace=grace
            )
        except BaseException:
            self._close_engine()
            raise

    def receive(self, version: int) -> list[tuple[str, Any]]:
        """Receives ``version``; returns ``[(name, tensor)]`` once it is complete on every
        rank, raises ``xfer.weights.VersionFailed`` (and leaves nothing to load) otherwise."""
        r = self.receiver
        if r is None:
            raise RuntimeError("StagedReceiver.receive after close")
        r.receive(version)
        return list(r.tensors())

    def close(self) -> None:
        """Leaves the group, frees the staging and closes the engine, even if leaving fails
        (idempotent)."""
        self._leave_and_close("receiver")
