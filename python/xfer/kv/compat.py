"""Whether two instances' KV caches can exchange blocks, beyond what each layer's view shows
(pure: no framework, no engine).

Two caches can have the same shapes and element type and still hold different things: fp8 as
e4m3 or e5m2 (both stored as bytes), another vLLM release's layout, an attention backend whose
kernels read the blocks otherwise, blocks of another size (a decode's manager block of 32 tokens
is not two of the prefill's 16), other KV cache groups (vLLM's hybrid allocator on one side
only), another drafter. Each worker publishes its *factors* with its record; a worker compares
a peer's with its own before it reads from or writes to it, and refuses the first that differs
by name (:func:`difference`). A factor one side does not publish is a difference too.

The speculative drafter is the exception: a drafter on one side only is allowed (the decoder's
drafter proposes worse without the prompt's KV, never wrong: the model verifies), two drafters
must be the same.

Factors travel as region names of the rendezvous record (``cf.<factor>-<value>``: 1 to 128 of
``A-Z a-z 0-9 . _ -``), so a value is cut to those characters and, if long, to a prefix and a
checksum of the whole.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping

FACTORS = {
    "vllm": "the vLLM version",
    "cache_dtype": "the KV cache dtype (--kv-cache-dtype; fp8 is fp8_e4m3)",
    "block_size": ("the block size (--block-size, per KV cache group; heterogeneous block "
                   "sizes, NIXL's block_size_ratio, are not supported)"),
    "kernel_block_size": "the attention kernels' block size (per KV cache group)",
    "attention_backend": "the attention backend",
    "kv_cache_groups": "the KV cache groups (vLLM's hybrid allocator: kinds and windows)",
    "speculative": "the speculative drafter (method, draft model, its KV cache dtype)",
}
"""Each factor's name, in the order they are compared, and what it is, for the refusal."""

NO_DRAFTER = "none"
"""The speculative factor of an instance without a drafter that holds KV."""

PREFIX = "cf."
"""Starts the tag of a factor's region name (layer tags are hex digits)."""

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
MAX_VALUE = 96
"""A value's characters in a region name, past which it is a prefix and a checksum."""


def safe_value(value: object) -> str:
    """``value`` in the characters a region name allows, at most :data:`MAX_VALUE` of them
    (a longer one: a prefix and the CRC-32 of the whole, so two long values still differ)."""
    text = str(value)
    safe = _UNSAFE.sub("_", text) or "_"
    if len(safe) > MAX_VALUE:
        safe = f"{safe[:MAX_VALUE - 9]}.{zlib.crc32(text.encode()):08x}"
    return safe


def tags(factors: Mapping[str, object]) -> dict[str, str]:
    """The record tags of ``factors`` (``cf.<factor>`` → its safe value)."""
    unknown = set(factors) - set(FACTORS)
    if unknown:
        raise ValueError(f"unknown compatibility factors {sorted(unknown)}")
    return {f"{PREFIX}{name}": safe_value(value) for name, value in factors.items()}


def from_tags(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A peer's factors from its record's (tag, value) pairs; tags of factors this build does
    not know are kept (a difference: that peer checks something this one does not)."""
    return {tag[len(PREFIX):]: value for tag, value in pairs if tag.startswith(PREFIX)}


def difference(ours: Mapping[str, str], theirs: Mapping[str, str]) -> str | None:
    """The first factor in which a peer differs, named with both values; None if none does.
    Both are :func:`tags`-safe values (``from_tags``, or ``tags`` of one's own)."""
    for name, what in FACTORS.items():
        here, there = ours.get(name), theirs.get(name)
        if name == "speculative" and NO_DRAFTER in (here, there):
            continue  # a drafter on one side only: see the module docs
        if here != there:
            return f"{what} differs: here {here!r}, there {there!r}"
    extra = sorted(set(theirs) - set(FACTORS))
    if extra:
        return f"the peer checks factors this connector does not know ({extra}): upgrade it"
    return None
