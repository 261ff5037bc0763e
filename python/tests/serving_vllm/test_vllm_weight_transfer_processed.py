"""xfer's vLLM weight-transfer backend on a model whose weights vLLM post-processes after
loading. A version must leave every worker exactly as vLLM's own reload
(``model_runner.reload_weights``: layerwise reload, then each layer's
``process_weights_after_loading``) leaves it with the same checkpoint — what the kernels
compute from, not only the parameters the loader writes.

The model: a small DeepSeek-V2 (multi-head latent attention: its attention layers derive
``W_UK_T`` / ``W_UV`` from ``kv_b_proj``; vLLM's CPU MLA backend, the platform's own choice
here) on vLLM's CPU platform as a CPU build of vLLM runs it: every linear layer's weight packed
into oneDNN's memory at processing (the layer's ``weight`` released, the embedding and LM head
keeping theirs beside a packed copy). The wheel has no oneDNN ops; vllm_cpu_onednn_standin.py
stands in for them (see there what that hides). The harness (vLLM's executor, TP 2, CPU
workers; vLLM's trainer factory over transformers' model as ``ModuleSource``) is
test_vllm_weight_transfer_api.py's."""

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import pytest

pytest.importorskip("vllm")

import test_vllm_weight_transfer_api as api  # noqa: E402
from weight_sync_checkpoint import full_tensor  # noqa: E402

DERIVED = ("W_UK_T", "W_UV")


def deepseek_v2_config():
    """Two dense layers of MLA: the latent cache of 512 + 64 that vLLM's CPU MLA backend
    takes, two heads per TP rank, no query LoRA; bf16."""
    from transformers import DeepseekV2Config

    return DeepseekV2Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        n_shared_experts=1, vocab_size=512, max_position_embeddings=256, tie_word_embeddings=False,
        torch_dtype="bfloat16", architectures=["DeepseekV2ForCausalLM"])


def model_tensors(model):
    """Every parameter, each MLA layer's derived weights, and the weight each CPU GEMM
    computes with (its ``cpu_linear`` applied to the identity: ``<layer>.cpu_linear``), by
    name (detached copies)."""
    import torch

    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        for attr in DERIVED:
            t = getattr(module, attr, None)
            if t is not None and hasattr(t, "detach"):
                out.setdefault(f"{prefix}.{attr}", t.detach().clone())
        gemm = getattr(module, "cpu_linear", None)
        k = getattr(module, "input_size_per_partition", None) or getattr(module, "embedding_dim", None)
        if gemm is not None and k:
            eye = torch.eye(int(k), dtype=torch.bfloat16)
            with torch.no_grad():
                out[f"{prefix}.cpu_linear"] = gemm(eye, module.weight, None).detach().clone()
    return out


def worker_against_vllms_reload(wrapper, shapes, seed):
    """This worker after a version: the tensors (derived ones included) that differ from what
    vLLM's own reload makes of version ``seed``'s full checkpoint here (run after the
    snapshot; it leaves the model at that version)."""
    import torch

    worker = wrapper.worker
    model = worker.get_model()
    engine = worker.weight_transfer_engine
    got = model_tensors(model)
    worker.model_runner.reload_weights(weights_iterator=iter([(n, full_tensor(n, s, seed)) for n, s in shapes]))
    want = model_tensors(model)
    return {
        "derived": sorted(n for n in want if n.rpartition(".")[2] in DERIVED),
        "packed": sorted(n for n in want if n.endswith(".cpu_linear")),
        "released": sorted(n for n, p in model.named_parameters() if p.numel() == 0),
        "wrong": sorted(n for n in want if n not in got or not torch.equal(got[n], want[n])),
        "boxes": sorted({b.piece[0] for b in engine.slices.boxes}),
        "whole": list(engine.slices.whole),
        "trace_failure": engine.trace_failure,
        "outcome": engine.last_outcome,
    }


@pytest.fixture(scope="module")
def vllm_mla_tp2(tmp_path_factory):
    yield from api.vllm_instance(tmp_path_factory, deepseek_v2_config(), standins=(
        "cpu_standin = vllm_cpu_standin:register", "cpu_onednn_standin = vllm_cpu_onednn_standin:register"))


def test_a_version_leaves_processed_weights_as_vllms_own_reload_does(vllm_mla_tp2):
    instance, url = vllm_mla_tp2
    trainer = api.Trainer(url, "api-mla", hf_config=deepseek_v2_config())
    engine = trainer.join(api.ExecutorClient(instance))
    try:
        for seed in (51, 52):
            trainer.step(seed)
            engine.send_weights()
            status, after = instance.ask("rpc", (worker_against_vllms_reload, (trainer.shapes, seed), {}))
            assert status == "ok", after
            for state in after:
                assert state["trace_failure"] == "" and state["outcome"]["applied"], state
                # Every tensor is received as this rank's slices (boxes), kv_b_proj included:
                # the path that writes parameters without vLLM's load_weights...
                assert state["whole"] == [] and len(state["boxes"]) == len(trainer.shapes), state
                assert any(".kv_b_proj." in n for n in state["boxes"]), state
                # ...and what vLLM makes of the loaded weights — the attention weights it
                # derives, the weights its GEMMs packed (the layers' own released) — is what
                # its reload makes of them.
                assert len(state["derived"]) == 2 * len(DERIVED), state
                assert any(".o_proj." in n for n in state["packed"]), state
                assert any(n.endswith("o_proj.weight") for n in state["released"]), state
                assert state["wrong"] == [], state
    finally:
        engine.shutdown()
