"""xfer.kv.compat: the factors two instances compare before KV moves between them (issue 54:
a mismatch refused by name). Pure: no framework."""

import pytest

from xfer.kv import compat

BASE = {"vllm": "0.33.0", "cache_dtype": "fp8_e4m3", "block_size": "16",
        "kernel_block_size": "16", "attention_backend": "FLASH_ATTN",
        "kv_cache_groups": "full", "speculative": compat.NO_DRAFTER}


def published(factors):
    """What a peer reads back from a record: the tags' (tag, value) pairs."""
    return compat.from_tags(compat.tags(factors).items())


def test_the_same_factors_pass():
    assert compat.difference(published(BASE), published(dict(BASE))) is None


@pytest.mark.parametrize("name,theirs,named", [
    ("cache_dtype", "fp8_e5m2", "KV cache dtype"),
    ("vllm", "0.32.1", "vLLM version"),
    ("block_size", "32", "block size"),
    ("kernel_block_size", "64", "kernel"),
    ("attention_backend", "FLASHINFER", "attention backend"),
    ("kv_cache_groups", "full_sw4096", "KV cache groups"),
    ("speculative", "eagle.some_drafter.fp8_e4m3", None),
])
def test_each_factor_is_refused_by_name(name, theirs, named):
    why = compat.difference(published(BASE), published({**BASE, name: theirs}))
    if named is None:  # a drafter on one side only is allowed
        assert why is None
        return
    assert why is not None and named in why and repr(theirs) in why


def test_two_different_drafters_are_refused():
    ours = {**BASE, "speculative": "eagle3.drafter-a.fp8_e4m3"}
    theirs = {**BASE, "speculative": "eagle3.drafter-b.fp8_e4m3"}
    assert "drafter" in compat.difference(published(ours), published(theirs))


def test_a_factor_missing_or_unknown_on_one_side_is_a_difference():
    partial = {k: v for k, v in BASE.items() if k != "attention_backend"}
    assert "attention backend" in compat.difference(published(BASE), published(partial))
    theirs = {**published(BASE), "checksum_of_the_future": "x"}
    assert "upgrade" in compat.difference(published(BASE), theirs)


def test_values_become_region_name_characters_and_long_ones_stay_distinct():
    a = "org/" + "x" * 200 + "/a"
    b = "org/" + "x" * 200 + "/b"
    ta, tb = compat.safe_value(a), compat.safe_value(b)
    assert ta != tb and len(ta) <= compat.MAX_VALUE and len(tb) <= compat.MAX_VALUE
    assert all(c.isalnum() or c in "._-" for c in ta)
    for tag, value in compat.tags({**BASE, "speculative": a}).items():
        assert len(f"v5-{tag}-{value}") <= 128


def test_unknown_own_factors_are_a_programming_error():
    with pytest.raises(ValueError):
        compat.tags({"colour": "red"})
