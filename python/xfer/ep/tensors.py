"""``xfer.ep`` on torch tensors: the same group, with torch tensors in and out (host memory;
a CUDA tensor is staged through the host, as the GPU path of docs/moe.md is not built).

Rows keep their bits: bf16 travels as its 16-bit patterns, and outputs are torch views of the
group's buffers where the layout allows (valid until the step two later)."""

from __future__ import annotations

import numpy as np
import torch

from .group import EpGroup, Handle
from .layout import EpConfig, from_f32

DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_TORCH = {v: k for k, v in DTYPES.items()}


def storage_of(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements as the numpy storage dtype (bf16 as uint16 bits), on the host."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def tensor_of(a: np.ndarray, dtype: str) -> torch.Tensor:
    """A numpy array of a storage dtype as a torch tensor of ``dtype`` (no copy)."""
    if dtype == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def config_for(x: torch.Tensor, topk_idx: torch.Tensor, ranks: int, num_experts: int, max_tokens: int, **kw) -> EpConfig:
    """The group's configuration for inputs shaped like these."""
    if x.dtype not in DTYPES:
        raise ValueError(f"dtype {x.dtype} is not one of {list(DTYPES)}")
    if num_experts % ranks:
        raise ValueError(f"{num_experts} experts do not split over {ranks} ranks")
    return EpConfig(ranks=ranks, experts_per_rank=num_experts // ranks, top_k=int(topk_idx.shape[1]),
                    max_tokens=max_tokens, hidden=int(x.shape[1]), dtype=DTYPES[x.dtype], **kw)


class TorchEpGroup:
    """An ``EpGroup`` with torch tensors at its edges."""

    def __init__(self, group: EpGroup):
        self.group = group
        self.cfg = group.cfg

    def dispatch_send(self, x: torch.Tensor, topk_idx: torch.Tensor, *, weights: torch.Tensor | None = None) -> Handle:
        """``weights``: given at dispatch, combine returns one partial sum per (token, rank)."""
        w = None if weights is None else storage_of(weights.to(torch.float32))
        return self.group.dispatch_send(storage_of(x), storage_of(topk_idx.to(torch.int64)), weights=w)

    def dispatch_recv(self, h: Handle, *, layout: str = "deepep", out: torch.Tensor | None = None):
        """``(recv_x, recv_count or expert_starts)`` as tensors (``recv_count`` int32); with
        fp8, ``recv_x`` is ``(values float8_e4m3fn, scales float32)``."""
        np_out = storage_of(out) if out is not None and layout == "deepep" and self.cfg.fp8 is None else None
        recv, meta = self.group.dispatch_recv(h, layout=layout, out=np_out)
        meta = torch.from_numpy(np.asarray(meta, dtype=np.int32 if layout == "deepep" else np.int64))
        if self.cfg.fp8 is not None:
            return (torch.from_numpy(recv[0]).view(torch.float8_e4m3fn), torch.from_numpy(recv[1])), meta
        return tensor_of(recv, self.cfg.dtype), meta

    def combine_send(self, h: Handle, expert_out: torch.Tensor) -> None:
        self.group.combine_send(h, storage_of(expert_out))

    def combine_recv(self, h: Handle, topk_weights: torch.Tensor | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 reduction, cast to the rows' dtype (into ``out`` if given); no weights
        when they were given at dispatch."""
        w = None if topk_weights is None else storage_of(topk_weights.to(torch.float32))
        y = self.group.combine_recv(h, w)
        result = tensor_of(from_f32(y, self.cfg.dtype), self.cfg.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out

    def dispatch(self, x, topk_idx, *, layout="deepep", weights=None):
        h = self.dispatch_send(x, topk_idx, weights=weights)
        recv, meta = self.dispatch_recv(h, layout=layout)
        return recv, meta, h

    def combine(self, expert_out, h, topk_weights=None, *, out=None):
        self.combine_send(h, expert_out)
        return self.combine_recv(h, topk_weights, out=out)

    def query_active_mask(self) -> torch.Tensor:
        return torch.from_numpy(self.group.query_active_mask())

    def begin_clean(self) -> dict:
        return self.group.begin_clean()

    def clean(self, infos=None) -> None:
        self.group.clean(infos)
