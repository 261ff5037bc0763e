"""KV-cache transfer between serving instances (prefill -> decode): the pure core and one thin
adapter per framework.

Pure (no framework import, unit-tested on their own):

- ``pages``: paged KV caches as xfer addresses them (layouts, vLLM's layer views, the runs of a
  block between tensor-parallel sizes, message framing).
- ``sglang_layout``: SGLang's rank pairing between TP sizes and the published KV shape.
- ``sglang_control``: the SGLang backend's messages, their per-room tokens and key proofs, and
  the checks against a rank's own records.
- ``control``: the one decoder of the connectors' control messages (bounded, typed fields)
  and the per-request tokens every message carries.
- ``params``: a request's ``kv_transfer_params`` (from API clients) parsed and bounded.
- ``compat``: the compatibility factors two instances compare before KV moves between them
  (vLLM version, cache dtype, block sizes, attention backend, KV cache groups, drafter), each
  refused by name.
- ``lease``: what a prefill rank keeps for its readers and answers them, from positive
  knowledge (claims before reads, "held" only for the reader it kept the blocks for).
- ``lookups``: how long the vLLM connector's lookup of a peer's record may wait (a record never
  found is only checked: a request's parameters may name any engine id).

Adapters (each imports its framework):

- ``vllm`` (with ``vllm_push`` and ``vllm_records``): vLLM 0.33's KV connector. vLLM loads it
  by ``kv_connector_module_path``: ``xfer.vllm`` stays that path (an alias of this module).
- ``sglang``: SGLang 0.5.23's disaggregation transfer backend; its entry point stays
  ``xfer.sglang:register``.

The old flat paths (``xfer.vllm``, ``xfer.sglang``, ``xfer._kvcache``, ``xfer._vllm_push``,
``xfer._vllm_records``, ``xfer._sglang_layout``) are the same module objects as these, so a
patch through either name reaches both.
"""
