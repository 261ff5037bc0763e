"""The SGLang backend's pure layout rules (no SGLang needed): which prefill ranks a decode
rank exchanges with across attention TP sizes, and the KV shape a prefill rank publishes and
a decode rank checks before any page moves."""

from __future__ import annotations

import dataclasses
import re

from .pages import Layout, LayoutError

PROTOCOL = 4
"""Bumped when the messages or the published layout change: peers of another refuse by name."""


def prefill_targets(decode_rank: int, decode_tp: int, prefill_tp: int, mla: bool) -> list[int]:
    """The prefill ranks a decode rank sends its page indices to: the ones its data comes
    from, and, when prefill has more ranks, every rank of its group (MLA: only the first
    writes; the others still need the indices to end their senders)."""
    if decode_tp >= prefill_tp:
        k = decode_tp // prefill_tp
        return [decode_rank // k]
    k = prefill_tp // decode_tp
    return [decode_rank * k + j for j in range(k)]


def decode_sources(prefill_rank: int, decode_tp: int, prefill_tp: int, mla: bool) -> list[int]:
    """The decode ranks that send a prefill rank their indices (the inverse of
    :func:`prefill_targets`): how many a prefill sender waits for."""
    return [r for r in range(decode_tp)
            if prefill_rank in prefill_targets(r, decode_tp, prefill_tp, mla)]


@dataclasses.dataclass(frozen=True)
class KvShape:
    """One rank's KV buffers as pages, what both sides check before moving any."""

    tp: int
    heads: int
    """KV heads on this rank (MLA: 1)."""
    page_size: int
    item_len: int
    """Bytes of one page of one buffer."""
    buffers: int
    mla: bool
    dp: int = 1
    """Data-parallel groups of the instance (``--dp-size``), each with its own ranks."""
    total: int = 0
    """The model's KV heads (SGLang's ``total_kv_head_num``; 0: unknown, then ``heads x
    tp``). Fewer than ``heads x tp``: heads are replicated over ranks."""
    http: int = 0
    """A prefill instance's HTTP port (``--port``; 0: unknown), where a decode rank asks for
    a retracted request's KV again (SGLang's rebootstrap ``/generate``)."""

    def name(self) -> str:
        """As a region name (rendezvous names allow A-Z a-z 0-9 . _ -)."""
        return (f"sgl{PROTOCOL}-tp{self.tp}-heads{self.heads}-page{self.page_size}-"
                f"item{self.item_len}-buffers{self.buffers}-mla{int(self.mla)}-dp{self.dp}-"
                f"total{self.total}-http{self.http}")

    @classmethod
    def parse(cls, name: str) -> "KvShape":
        m = re.fullmatch(r"sgl(\d+)-tp(\d+)-heads(\d+)-page(\d+)-item(\d+)-buffers(\d+)"
                         r"-mla([01])-dp(\d+)-total(\d+)-http(\d{1,5})", name)
        if m is None or int(m[1]) != PROTOCOL:
            raise LayoutError(f"the prefill published {name!r}: not protocol sgl{PROTOCOL}")
        tp, heads, page, item, buffers, mla, dp, total, http = (int(g) for g in m.groups()[1:])
        return cls(tp, heads, page, item, buffers, bool(mla), dp, total, http)

    def replicated(self) -> bool:
        """Whether ranks hold copies of the same heads (more ranks than KV heads)."""
        return not self.mla and 0 < self.total < self.heads * self.tp

    def layout(self, num_pages: int) -> Layout:
        """One buffer as a one-plane layout: pages of ``page_size`` tokens of ``heads`` heads
        (head sizes in bytes: the plan moves bytes, not elements)."""
        head_bytes = self.item_len // (self.page_size * self.heads)
        return Layout(planes=1, num_blocks=num_pages, block_bytes=self.item_len,
                      plane_pages=num_pages, dtype="bytes",
                      block_shape=(self.page_size, self.heads, head_bytes))

    def check_pair(self, prefill: "KvShape") -> None:
        """Refuses, naming the difference, a prefill this decode rank cannot receive from."""
        for what, here, there in (("page size", self.page_size, prefill.page_size),
                                  ("KV buffers", self.buffers, prefill.buffers),
                                  ("MLA", self.mla, prefill.mla)):
            if here != there:
                raise LayoutError(f"{what} differs: decode {here}, prefill {there}")
        if max(self.tp, prefill.tp) % min(self.tp, prefill.tp):
            raise LayoutError(f"attention TP sizes {prefill.tp} (prefill) and {self.tp} "
                              "(decode): one must divide the other")
        for side, shape in (("prefill", prefill), ("decode", self)):
            if shape.replicated() and self.tp != prefill.tp:
                raise LayoutError(
                    f"replicated KV heads ({side}: {shape.total} KV heads over attention TP "
                    f"{shape.tp}) between TP sizes {prefill.tp} (prefill) and {self.tp} "
                    "(decode) are not supported: run both at one TP size")
        if not self.mla and self.heads * self.tp != prefill.heads * prefill.tp:
            raise LayoutError(f"KV heads differ: decode {self.heads} x TP {self.tp}, prefill "
                              f"{prefill.heads} x TP {prefill.tp}")
        if self.mla or self.tp == prefill.tp:
            if self.item_len != prefill.item_len:
                raise LayoutError(f"page bytes differ: decode {self.item_len}, prefill "
                                  f"{prefill.item_len}")
            return
        if self.item_len // self.heads != prefill.item_len // prefill.heads:
            raise LayoutError(f"head sizes differ: decode {self.item_len // self.heads} bytes "
                              f"per page-head, prefill {prefill.item_len // prefill.heads}")
