"""The trainer side of xfer's vLLM weight-transfer backend: the engine
``WeightTransferTrainerFactory.trainer_init`` builds on every trainer rank
(``XferTrainerWeightTransferEngine``), its init info and staging defaults, the owners of each
tensor, and ``VersionNotApplied``, which every rank's ``send_weights`` raises for a version
some worker could not apply. Apart from the worker engine because it runs in the trainer's
processes, not vLLM's; what it reads from the workers and tells the other trainer ranks is
defined in ``vllm_contract``. The backend's overview is in ``vllm_engine``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from .engines import _Member as _EngineMember
from .executor import VersionFailed, WeightSender
from .layout import Layout, LayoutError, TensorSpec
from .vllm_contract import (
    BACKEND,
    OUTCOME_BYTES,
    _dtype_name,
    _read_receiver,
    _summary_record,
    decode_outcome,
    encode_summary,
    read_summary,
)


class VersionNotApplied(RuntimeError):
    """A version every rank received and the coordinator committed, that some worker could
    not apply (its ``load_weights`` or vLLM's processing raised): ``failed`` maps each such
    receiver rank to its reason. Those workers' layers are a mix of this version and the
    previous one; the other workers hold this version. The next version that applies whole
    repairs it (every version carries every tensor)."""

    def __init__(self, version: int, failed: dict[int, str]) -> None:
        listed = "; ".join(f"receiver {r}: {why}" for r, why in sorted(failed.items()))
        super().__init__(f"weight version {version} was committed but not applied on {len(failed)} "
                         f"worker(s) (their layers are a mix of versions until one applies whole): {listed}")
        self.version = version
        self.failed = failed


# The trainer's staging by default: two buckets of 2 GiB, verl's default bucket
# (``update_weights_bucket_megabytes: 2048``), each made as large as the largest tensor the
# rank sends when one is larger and as small as all of them when they fit.
DEFAULT_BUCKET_BYTES = 2048 << 20
DEFAULT_BUDGET_BYTES = 2 * DEFAULT_BUCKET_BYTES


@dataclasses.dataclass
class XferTrainerInitInfo(TrainerInitInfo):
    """The trainer side's init info (every trainer rank; ``rank`` is its trainer rank).
    ``receivers``: every vLLM worker joined to ``group`` (TP × PP × DP of each instance);
    ``senders``: the trainer ranks (each writes its share of the plan, from the tensors its
    source's ``ParamMeta.owners`` give it); ``budget_bytes``: a trainer rank's staging, two
    buckets of half of it (default ``DEFAULT_BUDGET_BYTES``): each tensor the source yields is
    copied into one and let go while the other's writes are in flight, so at most the two
    buckets and the tensor being gathered are held, whatever the model's size; a bucket grows
    to the largest tensor this rank sends (it must hold one). ``None``: the tensors are written
    from their own memory, each registered once while the source gives the same memory back —
    every tensor of a version is held until it is written, so only for a source whose tensors
    are memory it keeps anyway (a plain module's own parameters), never a gathering one."""

    backend = BACKEND

    rendezvous: str = ""
    group: str = ""
    receivers: int = 1
    senders: int = 1
    rank_base: int = 0
    config: Any = None
    timeout: float = 300.0
    grace: float | None = None
    budget_bytes: int | None = DEFAULT_BUDGET_BYTES
    direct: bool = True
    max_bytes: int | None = None


def _owned(source: Any, senders: int) -> dict[str, tuple[int, ...]]:
    """Each tensor's owners from the source's ``ParamMeta.owners`` (``None``: every trainer
    rank), checked to be trainer ranks of this group."""
    out: dict[str, tuple[int, ...]] = {}
    for m in source.metadata:
        owners = getattr(m, "owners", None)
        if owners is None:
            out[m.name] = tuple(range(senders))
            continue
        owners = tuple(int(o) for o in owners)
        bad = [o for o in owners if not 0 <= o < senders]
        if bad or not owners:
            raise ValueError(f"parameter {m.name!r}: owners {owners} are not all trainer ranks of the "
                             f"{senders} senders (XferTrainerInitInfo.senders)")
        out[m.name] = owners
    return out


class XferTrainerWeightTransferEngine(TrainerWeightTransferEngine):
    """The trainer side: every trainer rank sends its share of each version (of the tensors it
    owns); rank 0 (vLLM's sender) also drives the workers through ``client``, coordinates the
    version, reads each worker's outcome once the session is finished and publishes what it
    read, which every other trainer rank reads: every rank raises the same
    ``VersionNotApplied``."""

    init_info_cls = XferTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, is_sender: bool, rank: int, info: XferTrainerInitInfo,
                 member: _EngineMember, sender: WeightSender, layout: Layout, outcomes: tuple[Any, ...] = ()) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender, rank=rank)
        self.info = info
        self._member: _EngineMember | None = member
        self.sender: WeightSender | None = sender
        self.layout = layout
        self.version = 0
        # This rank's shard of each tensor it owns (in the source's metadata order).
        self._shard_of = {name: i for i, (r, name, _) in enumerate(layout.shards) if r == rank}
        # Each worker's outcome region, read into one local buffer after each version.
        self._outcomes = outcomes
        self._outcome_buf = np.zeros(max(1, len(outcomes)) * OUTCOME_BYTES, dtype=np.uint8)
        self._outcome_region = member.engine.reg_mr(self._outcome_buf, access="local") if outcomes else None
        # Rank 0's summaries of the last versions, published for the other trainer ranks.
        self._summaries: list[tuple[Any, Any]] = []
        self._summary_bound = OUTCOME_BYTES * (1 + info.receivers)

    @classmethod
    def trainer_init(cls, init_info: XferTrainerInitInfo, *, client: Any, source: Any = None) -> XferTrainerWeightTransferEngine:
        if source is None:
            raise ValueError("the xfer trainer engine sends a WeightSource each version (source=...)")
        if not init_info.rendezvous or not init_info.group:
            raise ValueError("XferTrainerInitInfo: rendezvous (xfer://host:port) and group are required")
        tensors = tuple(TensorSpec(m.name, tuple(int(d) for d in m.shape), _dtype_name(m.dtype)) for m in source.metadata)
        owners = _owned(source, init_info.senders)
        budget = init_info.budget_bytes
        if budget is not None:
            mine = [t.nbytes for t in tensors if init_info.rank in owners[t.name]]
            bucket = max(max(mine, default=1), min(budget // 2, sum(-(-n // 64) * 64 for n in mine)))
            budget = 2 * bucket
        is_sender = init_info.rank == 0
        member = _EngineMember(init_info.rendezvous, init_info.config, "XferTrainerInitInfo")
        try:
            sender = WeightSender(
                member.engine, member.rendezvous, init_info.group, init_info.rank, init_info.senders,
                init_info.receivers, timeout=init_info.timeout, grace=init_info.grace, budget_bytes=budget,
            )
            if is_sender:
                client.init_weight_transfer_engine({
                    "rendezvous": init_info.rendezvous, "group": init_info.group,
                    "tensors": [[t.name, list(t.shape), t.dtype] for t in tensors],
                    "receivers": init_info.receivers, "senders": init_info.senders, "rank_base": init_info.rank_base,
                    "config": init_info.config, "timeout": init_info.timeout, "grace": init_info.grace,
                    "direct": init_info.direct, "max_bytes": init_info.max_bytes,
                })
            params = []
            outcomes = []
            deadline = time.monotonic() + init_info.timeout
            for r in range(init_info.receivers):
                part, outcome = _read_receiver(member.engine, member.rendezvous, init_info.group, r, tensors, deadline)
                params.extend(part.params)
                outcomes.append(outcome)
            # Each tensor held whole by each of its owners: the plan shares its bytes among them.
            shards = tuple((s, t.name, None) for s in range(init_info.senders) for t in tensors if s in owners[t.name])
            layout = Layout(tensors, shards, tuple(params))
            engine = cls(client=client, source=source, is_sender=is_sender, rank=init_info.rank, info=init_info,
                         member=member, sender=sender, layout=layout, outcomes=tuple(outcomes) if is_sender else ())
        except BaseException:
            if "sender" in locals():
                sender.close()
            member._close_engine()
            raise
        return engine

    def send_weights(self) -> None:
        """One version: rank 0 starts the workers' update and calls their ``update_weights``
        while every trainer rank writes its share, then finishes the session — always, also
        after a failure — and reads every worker's outcome. Each rank's tensors are streamed
        (``budget_bytes``): the source's next tensor is gathered while the last one's writes
        are in flight. Returns once the version is committed and applied on every worker;
        raises ``VersionFailed`` when it was applied nowhere, and ``VersionNotApplied``
        (naming the version and each worker that could not apply it, with its reason) when it
        was committed but some worker's apply failed — on every trainer rank: rank 0 publishes
        what it read, the others wait for it (up to ``timeout``). Either way the session is
        closed and the next version can be sent."""
        s = self.sender
        if s is None:
            raise RuntimeError("send_weights after shutdown")
        self.version += 1
        version = self.version
        shard_of = self._shard_of

        def shards() -> Iterator[tuple[int, Any]]:
            for name, t in self.source.iter_full():
                index = shard_of.get(name)
                if index is None:
                    raise ValueError(f"the source yielded {name!r}, which trainer rank {self.rank} does not own "
                                     "(its ParamMeta.owners) or the source's metadata does not declare")
                yield index, t
                del t  # not held here while the next one is gathered

        rpc_error: list[BaseException] = []
        rpc: threading.Thread | None = None
        if self.is_sender:
            self.client.start_weight_update()

            def update() -> None:
                try:
                    self.client.update_weights({"version": version})
                except BaseException as e:  # noqa: BLE001 - raised on the trainer's thread below
                    rpc_error.append(e)

            rpc = threading.Thread(target=update, name=f"xfer-vllm-update-{version}", daemon=True)
            rpc.start()
        failed: VersionFailed | None = None
        concluded: list[dict[int, str]] = []
        try:
            try:
                if self.info.budget_bytes is None:
                    s.send(version, self.layout, dict(shards()))
                else:
                    s.send(version, self.layout, shards())
            except VersionFailed as e:
                failed = e
            finally:
                if rpc is not None:
                    rpc.join()
        except BaseException as e:
            rpc_error.append(e)
            raise
        finally:
            if self.is_sender:
                try:
                    # Always: a worker left in its session refuses every later
                    # start_weight_update. The workers' update_weights never raise for a
                    # version (see XferWeightTransferEngine.receive_weights), so their answers
                    # are in step.
                    self.client.finish_weight_update()
                except BaseException as e:
                    rpc_error.append(e)
                    raise
                finally:
                    if failed is None:
                        concluded.append(self._conclude(version, rpc_error))
        if rpc_error:
            raise rpc_error[0]
        if failed is not None:
            raise failed
        not_applied = concluded[0] if self.is_sender else self._hear_summary(version)
        if not_applied:
            raise VersionNotApplied(version, not_applied)

    def _conclude(self, version: int, rpc_error: list[BaseException]) -> dict[int, str]:
        """Rank 0, once the workers' session of a committed ``version`` is finished: the
        workers that did not apply it (their outcomes read now), and that — or the error that
        stopped rank 0 driving the session — published under ``_summary_record`` for the
        other trainer ranks. The last 16 versions' stay published (a rank reads its version's
        once it committed it, and rank 0 cannot run far ahead of it: a version commits only
        with every rank's report)."""
        error = f"{type(rpc_error[0]).__name__}: {rpc_error[0]}" if rpc_error else ""
        failed: dict[int, str] = {}
        if not rpc_error:
            try:
                failed = self._not_applied(version)
            except Exception as e:
                error = f"reading the workers' outcomes failed: {type(e).__name__}: {e}"
                rpc_error.append(e)
        member = self._member
        if member is None or self.info.senders == 1:
            return failed
        raw = encode_summary(version, error, failed, self._summary_bound)
        buf = np.frombuffer(bytearray(raw), dtype=np.uint8)
        region = member.engine.reg_mr(buf, access="read")
        try:
            published = member.rendezvous.publish(_summary_record(self.info.group, version), member.engine.main_address,
                                                  {"summary": region.desc}, ttl=max(2.0, self.info.timeout))
        except BaseException:
            region.dereg()
            raise
        self._summaries.append((published, region, buf))
        while len(self._summaries) > 16:
            old, old_region, _ = self._summaries.pop(0)
            old.unpublish()
            old_region.dereg()
        return failed

    def _hear_summary(self, version: int) -> dict[int, str]:
        """A trainer rank other than 0: rank 0's summary of committed ``version``, waited for
        (up to ``timeout``), checked to come from rank 0's engine, bounded and decoded. Raises
        what stopped rank 0 driving the workers; returns the workers that did not apply it."""
        s, member = self.sender, self._member
        assert s is not None and member is not None
        deadline = time.monotonic() + self.info.timeout
        coordinator = s.record(0, deadline)
        return read_summary(member.engine, member.rendezvous, self.info.group, version,
                            coordinator[0] if coordinator is not None else None, self.info.receivers,
                            self._summary_bound, deadline)

    def _not_applied(self, version: int) -> dict[int, str]:
        """Each worker's outcome of ``version`` read from its outcome region: the receiver
        ranks that did not apply it, with their reasons."""
        region = self._outcome_region
        member = self._member
        if region is None or member is None:
            return {}
        deadline = time.monotonic() + self.info.timeout
        for r, desc in enumerate(self._outcomes):
            member.engine.submit_single_read(region, desc, OUTCOME_BYTES, local_offset=r * OUTCOME_BYTES).wait(
                max(0.0, deadline - time.monotonic()))
        failed: dict[int, str] = {}
        for r in range(len(self._outcomes)):
            raw = self._outcome_buf[r * OUTCOME_BYTES:(r + 1) * OUTCOME_BYTES].tobytes()
            try:
                got, applied, reason = decode_outcome(raw)
            except LayoutError as e:
                failed[r] = f"an unreadable outcome ({e})"
                continue
            if got != version:
                failed[r] = f"its last outcome is of version {got}, not {version}"
            elif not applied:
                failed[r] = reason
        return failed

    def shutdown(self) -> None:
        sender, member, region = self.sender, self._member, self._outcome_region
        summaries, self._summaries = self._summaries, []
        self.sender = self._member = self._outcome_region = None
        try:
            for published, summary, _ in summaries:
                published.unpublish()
                summary.dereg()
            if sender is not None:
                sender.close()
            if region is not None:
                region.dereg()
        finally:
            if member is not None:
                member._close_engine()
