"""KV caches as vLLM 0.33 itself allocates them, for the connector tests (no hand-made cache).

The path is the engine's: the model's KV cache specs (what its attention layers report — here
built from a config-only model's ModelConfig, as `Attention.get_kv_cache_spec` builds them:
constructing the model needs vLLM's compiled ops, which the PyPI wheel has only for CUDA),
the layout resolved by `resolve_kv_cache_layout` from the attention backend's supported set,
the connector's `get_required_kvcache_layout` and `VLLM_KV_CACHE_LAYOUT` (as
`EngineCore._initialize_kv_caches` does), `get_kv_cache_configs` for the blocks, and
`allocate_kv_cache` for the tensors the model runner hands to `register_kv_caches`: one
backing buffer, one strided view per layer.
"""

from __future__ import annotations

import json
from typing import Any

import torch

LLAMA_TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 8,
    "num_key_value_heads": 4, "vocab_size": 1000, "max_position_embeddings": 512,
    "torch_dtype": "float16",
}
"""Llama-shaped: 4 KV heads of 8 (hidden 64 over 8 attention heads)."""

DEEPSEEK_V2_TINY = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "kv_lora_rank": 64, "q_lora_rank": None, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32,
    "v_head_dim": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "vocab_size": 1000,
    "max_position_embeddings": 2048, "rope_theta": 10000, "torch_dtype": "bfloat16",
}


def write_model(directory, config: dict[str, Any] | None = None, **overrides: Any) -> None:
    """A config.json-only model in ``directory`` (nothing downloaded)."""
    (directory / "config.json").write_text(json.dumps({**(config or LLAMA_TINY), **overrides}))


def load_model_config(directory, max_model_len: int = 64):
    """vLLM's ModelConfig of the model in ``directory``."""
    from vllm.config import ModelConfig

    return ModelConfig(model=str(directory), skip_tokenizer_init=True, max_model_len=max_model_len)


def model_config(directory, config: dict[str, Any] | None = None, **overrides: Any):
    """vLLM's ModelConfig of a config.json-only model written to ``directory``."""
    write_model(directory, config, **overrides)
    return load_model_config(directory)


def backend_class(name: str):
    """One of the attention backends vLLM ships, by the name its registry uses."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name].get_class()


def kv_cache_specs(vllm_config, layers: list[str],
                   sliding: dict[str, int] | None = None) -> dict[str, Any]:
    """What each attention layer of the model reports (`get_kv_cache_spec`): a layer named in
    ``sliding`` attends to a window of that many tokens, as a sliding-window layer of a hybrid
    model (Gemma 3, gpt-oss, Mistral) reports it."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    model, cache = vllm_config.model_config, vllm_config.cache_config
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    # As the attention layer picks it (fp8 is kept as uint8 bytes).
    dtype = kv_cache_dtype_str_to_dtype(cache.cache_dtype, model)
    if model.use_mla:
        spec = MLAAttentionSpec(block_size=cache.block_size, num_kv_heads=1,
                                head_size=model.get_head_size(), dtype=dtype,
                                cache_dtype_str=cache.cache_dtype)
    else:
        spec = FullAttentionSpec(block_size=cache.block_size,
                                 num_kv_heads=model.get_num_kv_heads(vllm_config.parallel_config),
                                 head_size=model.get_head_size(), dtype=dtype)
    specs = {name: spec for name in layers}
    for name, window in (sliding or {}).items():
        specs[name] = SlidingWindowSpec(block_size=spec.block_size, num_kv_heads=spec.num_kv_heads,
                                        head_size=spec.head_size, dtype=spec.dtype,
                                        sliding_window=window)
    return specs


def allocate(vllm_config, layers: list[str], num_blocks: int, backend: str = "CPU_ATTN",
             layout: str | None = None, sliding: dict[str, int] | None = None):
    """The KV cache config and the per-layer tensors vLLM allocates for ``layers`` with
    ``num_blocks`` blocks, laid out as ``backend`` and the connector resolve it (or as a user's
    ``VLLM_KV_CACHE_LAYOUT=layout`` forces it); ``sliding`` as in `kv_cache_specs`. The views
    are in the kernel blocks ``backend``'s class takes (``prepare_kernel_block_sizes`` over an
    attention group of it, as the GPU model runner computes them): FlashInfer's kernels take
    16/32/64 tokens, so at ``--block-size 128`` each manager block is two rows of 64."""
    import os

    previous = os.environ.get("VLLM_KV_CACHE_LAYOUT")
    if layout is not None:
        os.environ["VLLM_KV_CACHE_LAYOUT"] = layout
    try:
        return _allocate(vllm_config, layers, num_blocks, backend, sliding)
    finally:
        if previous is None:
            os.environ.pop("VLLM_KV_CACHE_LAYOUT", None)
        else:
            os.environ["VLLM_KV_CACHE_LAYOUT"] = previous


def _allocate(vllm_config, layers: list[str], num_blocks: int, backend: str,
              sliding: dict[str, int] | None):
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.worker.utils import AttentionGroup, allocate_kv_cache, prepare_kernel_block_sizes

    specs = kv_cache_specs(vllm_config, layers, sliding)
    attention_layers(vllm_config, specs, backend)
    supported = [layout.name for layout in get_supported_kv_cache_layouts([backend_class(backend)])]
    layout = resolve_kv_cache_layout(vllm_config, [supported], specs.values())
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    page = next(iter(specs.values())).page_size_bytes
    [config] = get_kv_cache_configs(vllm_config, [specs], [page * num_blocks * len(layers)], groups)
    config.kv_cache_layout = vllm_config.cache_config.kv_cache_layout
    attn_groups = [[AttentionGroup(backend_class(backend), list(group.layer_names),
                                   group.kv_cache_spec, index)]
                   for index, group in enumerate(config.kv_cache_groups)]
    try:
        kernel_block_sizes = prepare_kernel_block_sizes(config, attn_groups)
    except ValueError:
        # The CPU backend takes multiples of 32 and the connector tests run blocks of 16: the
        # views are then manager blocks, as FLASH_ATTN (multiples of 16) gives them.
        kernel_block_sizes = None
    return config, allocate_kv_cache(config, torch.device("cpu"), layout, kernel_block_sizes)


def attention_layers(vllm_config, specs: dict[str, Any], backend: str) -> None:
    """The model's attention layers where vLLM keeps them (the config's
    ``static_forward_context``, which connectors read: NixlConnector's and xfer's compatibility
    factors name their backends), each a stand-in for the model's ``Attention`` that reports
    ``backend``'s class and its spec (building the real layers needs the model's weights and
    vLLM's compiled ops; their backend is the platform's choice, CPU_ATTN on this machine)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    cls = backend_class(backend)

    class Layer(AttentionLayerBase):
        def __init__(self, spec):
            self.spec = spec

        def get_attn_backend(self):
            return cls

        def get_kv_cache_spec(self, vllm_config):
            return self.spec

    context = vllm_config.compilation_config.static_forward_context
    for name, spec in specs.items():
        context[name] = Layer(spec)
