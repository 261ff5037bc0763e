"""DeepEP's low-latency ``Buffer`` on xfer: what vLLM's ``DeepEPLLPrepareAndFinalize`` and
``DeepEPLLAll2AllManager`` and SGLang's low-latency DeepEP dispatcher call, mask API included.

Selected by an explicit opt-in, without editing the framework: put :func:`shim_path` first on
``PYTHONPATH`` (``PYTHONPATH=$(python -m xfer.ep.deep_ep --path)``); its ``deep_ep`` package
re-exports this module, so ``import deep_ep`` finds xfer's before any real DeepEP. Without the
opt-in a real ``deep_ep`` (if installed) is untouched. Then run vLLM with
``--all2all-backend deepep_low_latency`` or SGLang with ``--moe-a2a-backend deepep
--deepep-mode low_latency``.

The engine comes from ``$XFER_EP_CONFIG`` (a config file, or a JSON object), else
``$XFER_CONFIG``; each wait of a step may take ``$XFER_EP_TIMEOUT`` seconds (default 10)
before its rank is masked. Provided: bf16 dispatch, fp8 dispatch (``use_fp8=True``: e4m3
values and a float32 scale per 128 channels, ``round_scale`` for power-of-two scales), the hook
and synchronous forms, ``out=``, the receive statistics, the mask buffer. Not provided (raise
``NotImplementedError``): ue8m0-packed scales, nvfp4/mxfp dispatch, ``zero_copy`` combine,
overlap signals, normal (high-throughput) mode. Tensors live on the host: a CUDA input is staged through it."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import torch

from .group import EpError, EpGroup
from .layout import EpConfig
from .tensors import TorchEpGroup, config_for, storage_of, tensor_of

__all__ = ["Buffer", "Config", "EventOverlap", "shim_path"]


def shim_path() -> str:
    """The directory whose ``deep_ep`` package is this module (prepend it to PYTHONPATH)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "deep_ep_shim")


class EventOverlap:
    """DeepEP's event: every operation here has finished when its call (or hook) returns."""

    def __init__(self, event=None, extra_tensors=None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *args):
        return False


class Config:
    """DeepEP's normal-mode tuning config (accepted, unused: normal mode is not provided)."""

    def __init__(self, num_sms: int = 20, *args):
        self.num_sms = num_sms
        self.args = args

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0


#: Stage CPU tensors as device tensors are (separate output tensors filled when the receive
#: runs): the tests' stand-in for device memory, which the CPU machines here do not have.
STAGE_CPU_TENSORS = False


def _staged(device: torch.device) -> bool:
    return device.type != "cpu" or STAGE_CPU_TENSORS


def _parts(t):
    return t if isinstance(t, tuple) else (t,)


def _engine_config():
    raw = os.environ.get("XFER_EP_CONFIG")
    if not raw:
        return None
    if raw.lstrip().startswith("{"):
        return json.loads(raw)
    return raw


class _Handle:
    """What combine needs from its dispatch (opaque to the frameworks, as DeepEP's tuple is)."""

    def __init__(self, ep: TorchEpGroup, h, num_tokens: int):
        self.ep, self.h, self.num_tokens = ep, h, num_tokens


class Buffer:
    """DeepEP's ``Buffer``, low-latency mode, over an xfer engine and ``group`` (a
    ``torch.distributed`` process group, used once per shape to exchange addresses)."""

    num_sms = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 use_fabric: bool = False, comm=None, **_ignored):
        import xfer

        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        # DeepEP masks a rank that misses its deadline only in shrink mode (vLLM sets it with
        # --enable-fault-tolerance); without it a silent rank is an error, never zeros.
        self.enable_shrink = enable_shrink
        self.timeout = float(os.environ.get("XFER_EP_TIMEOUT", "10"))
        self.engine = xfer.TransferEngine(_engine_config())
        self._groups: dict[tuple, TorchEpGroup] = {}
        self._scratch = None
        self._lock = threading.Lock()

    # -- static surface ---------------------------------------------------------------------
    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        """Bytes xfer registers per rank for this shape (bf16, up to top-8)."""
        cfg = EpConfig(ranks=num_ranks, experts_per_rank=max(1, num_experts // num_ranks), top_k=8,
                       max_tokens=num_max_dispatch_tokens_per_rank, hidden=hidden, partial_sums=False)
        return int(sum(2 * v for k, v in cfg.region_bytes().items() if k in ("send", "dispatch", "combine_send", "combine")))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        raise NotImplementedError("xfer's deep_ep provides the low-latency mode only")

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        raise NotImplementedError("xfer's deep_ep provides the low-latency mode only")

    # -- the group per shape ----------------------------------------------------------------
    def _ep(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, fp8=None) -> TorchEpGroup:
        key = (int(x.shape[1]), x.dtype, int(topk_idx.shape[1]), int(num_max_dispatch_tokens_per_rank), int(num_experts), fp8)
        with self._lock:
            ep = self._groups.get(key)
            if ep is None:
                import torch.distributed as dist

                # A tag of its own per shape: groups on one engine must not share immediates.
                # Every rank creates its groups in the same order (the all-gather below is
                # collective), so the tags agree.
                if len(self._groups) >= 16:
                    raise ValueError("xfer's deep_ep keeps at most 16 shapes per Buffer (one immediate tag each)")
                cfg = config_for(x, topk_idx, self.group_size, num_experts, num_max_dispatch_tokens_per_rank,
                                 timeout=self.timeout, fp8=fp8, tag=(0xE - len(self._groups)) % 16,
                                 partial_sums=False)  # DeepEP gives the weights at combine
                g = EpGroup(self.engine, self.rank, cfg)
                infos = [None] * self.group_size
                dist.all_gather_object(infos, g.local_info(), group=self.group)
                g.connect(infos)
                ep = self._groups[key] = TorchEpGroup(g)
            return ep

    # -- low-latency dispatch and combine ---------------------------------------------------
    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: torch.Tensor | None = None,
                             dispatch_wait_recv_cost_stats: torch.Tensor | None = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, **unsupported):
        """``(recv_x [local_experts, ranks × max_tokens, hidden], recv_count [local_experts]
        int32, handle, event, hook)``; with ``return_recv_hook`` the tensors are filled when
        ``hook()`` returns."""
        if use_ue8m0 or any(unsupported.get(k) for k in ("use_nvfp4", "use_mxfp4", "use_mxfp8")):
            raise NotImplementedError("xfer's deep_ep dispatches bf16 or fp8 with float32 scales (no ue8m0, nvfp4, mxfp)")
        if use_fp8 and x.dtype != torch.bfloat16:
            raise ValueError("fp8 dispatch quantizes bf16 tokens")
        fp8 = ("e4m3_pow2" if round_scale else "e4m3") if use_fp8 else None
        ep = self._ep(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, fp8)
        cfg = ep.cfg
        h = ep.dispatch_send(x, topk_idx)
        recv_np = ep.group.recv_buffer(h.epoch)
        if fp8 is None:
            recv_x = tensor_of(recv_np, cfg.dtype)
        else:
            # DeepEP's pair: e4m3 values [experts, ranks × max_tokens, hidden] and float32
            # scales [..., hidden / 128], both contiguous here.
            recv_x = (torch.from_numpy(recv_np[0]).view(torch.float8_e4m3fn), torch.from_numpy(recv_np[1]))
        recv_count = torch.zeros(cfg.experts_per_rank, dtype=torch.int32)
        device = x.device
        # On a device, the caller's tensors are filled when the receive runs (at once, or in
        # the hook), never copied before it: they would hold an older step's rows.
        stage = _staged(device)
        out_x = tuple(torch.empty_like(t, device=device) for t in _parts(recv_x)) if stage else _parts(recv_x)
        out_count = torch.zeros_like(recv_count, device=device) if stage else recv_count

        def receive():
            _, counts = ep.group.dispatch_recv(h, layout="deepep", out=recv_np)
            recv_count.copy_(torch.from_numpy(np.asarray(counts, dtype=np.int32)))
            if stage:
                for dst, src in zip(out_x, _parts(recv_x)):
                    dst.copy_(src)
                out_count.copy_(recv_count)
            if cumulative_local_expert_recv_stats is not None:
                cumulative_local_expert_recv_stats.add_(recv_count.to(cumulative_local_expert_recv_stats.device))
            self._refuse_masked(ep)

        handle = _Handle(ep, h, int(x.shape[0]))
        result_x = out_x if fp8 is not None else out_x[0]
        if return_recv_hook:
            return result_x, out_count, handle, EventOverlap(), receive
        receive()
        return result_x, out_count, handle, EventOverlap(), None

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: _Handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: torch.Tensor | None = None,
                            combine_wait_recv_cost_stats: torch.Tensor | None = None, **unsupported):
        """``(combined_x [tokens, hidden], event, hook)``: each token's expert outputs weighted
        and summed in fp32, then cast to the rows' dtype."""
        if zero_copy or use_logfmt or unsupported.get("overlap"):
            raise NotImplementedError("xfer's deep_ep: no zero_copy, logfmt or overlap combine")
        ep, h = handle.ep, handle.h
        ep.combine_send(h, x)
        dtype = x.dtype
        result = out if out is not None else torch.empty((handle.num_tokens, ep.cfg.hidden), dtype=dtype, device=x.device)

        def receive():
            y = ep.combine_recv(h, topk_weights)
            result.copy_(y)
            self._refuse_masked(ep)

        if return_recv_hook:
            return result, EventOverlap(), receive
        receive()
        return result, EventOverlap(), None

    def get_next_low_latency_combine_buffer(self, handle):
        raise NotImplementedError("xfer's deep_ep has no zero-copy combine buffer")

    # -- masks and cleaning -----------------------------------------------------------------
    def _refuse_masked(self, ep: TorchEpGroup) -> None:
        """Without ``enable_shrink`` a masked rank is an error (its tokens would silently count
        zero; DeepEP without shrink mode stops too, by its timeout). Raised on every call
        until a clean."""
        if self.enable_shrink:
            return
        masked = [r for r, a in enumerate(ep.group.query_active_mask()) if not a]
        if masked:
            raise EpError(
                f"rank(s) {masked} missed their deadlines ({self.timeout:g} s each, $XFER_EP_TIMEOUT): their "
                "tokens would count as zero. This Buffer was made without enable_shrink (vLLM sets it with "
                "--enable-fault-tolerance), so that is an error, as in DeepEP")

    def _mask(self) -> np.ndarray:
        masked = np.zeros(self.group_size, dtype=np.int32)
        for ep in self._groups.values():
            masked |= 1 - ep.group.query_active_mask()
        return masked

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes 1 for each rank masked (missed a deadline), 0 for the others — what vLLM's
        ``query_fault`` reads as a fault."""
        mask_status.copy_(torch.from_numpy(self._mask()).to(mask_status.dtype))

    def low_latency_clean_mask_buffer(self) -> None:
        """Every rank active again — a local call, as DeepEP's (it clears the mask; vLLM's
        ``clean_buffers`` makes it on every rank with no barrier of its own, while the
        process group may hold a dead rank): the masks and what the masked steps left in the
        ImmCounter are cleared (``EpGroup.clean()``). The regions and epochs stay, so the
        ranks must have run the same steps (vLLM's data-parallel ranks do: each runs every
        step, a dummy batch when idle); for a clean that agrees the epoch and refuses a masked
        rank's late writes, ``clean_low_latency_buffer``."""
        for ep in self._groups.values():
            ep.clean()

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int = 0, hidden: int = 0,
                                 num_experts: int = 0) -> None:
        """Collective, as DeepEP's (a barrier on every rank around clearing the buffer): every
        rank's groups re-form — new regions (the writes of before can land in no later step),
        their records all-gathered through ``group``, every mask cleared and one epoch agreed
        (``EpGroup.begin_clean`` / ``clean``). Call it on every rank once nothing is in flight.
        Nothing needs zeroing: every count header carries its step, so stale bytes are never
        read. The shape arguments are DeepEP's; every shape's group is re-formed."""
        import torch.distributed as dist

        with self._lock:
            mine = [(repr(key), ep.group.begin_clean()) for key, ep in self._groups.items()]
            every = [None] * self.group_size
            dist.all_gather_object(every, mine, group=self.group)
            for r, theirs in enumerate(every):
                if not isinstance(theirs, list) or [k for k, _i in theirs] != [k for k, _i in mine]:
                    raise ValueError(f"rank {r} has other shapes than rank {self.rank}: every rank creates its shapes alike")
            for i, ep in enumerate(self._groups.values()):
                ep.group.clean([theirs[i][1] for theirs in every])

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: torch.Size | None = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A scratch tensor of ``num_rdma_bytes`` (vLLM zeroes it in ``clean_buffers``); the
        protocol's own regions need no zeroing."""
        if self._scratch is None:
            self._scratch = torch.zeros(max(64, int(self.num_rdma_bytes or 0)), dtype=torch.uint8)
        t = self._scratch[offset:].view(dtype)
        return t if size is None else t[: int(np.prod(size))].view(size)

    def destroy(self) -> None:
        for ep in self._groups.values():
            ep.group.close()
        self._groups.clear()
        if not self.engine.closed:
            self.engine.close()


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--path"]:
        print(shim_path())
    else:
        print("usage: python -m xfer.ep.deep_ep --path   (prepend it to PYTHONPATH to select xfer's deep_ep)")
