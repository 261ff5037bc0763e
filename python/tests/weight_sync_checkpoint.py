"""What the weight-sync tests of both engines share (vLLM's worker extension, SGLang's custom
weight loader): a config-only small Qwen2 checkpoint (fused ``qkv_proj`` and ``gate_up_proj``
in the engines' models), its seeded tensors, what each engine parameter must hold after
``load_weights``, the trainer rank's process and a pipe-driven child process. Imported by the
test modules and by their spawned children (``sys.path`` travels with ``spawn``)."""

import os
import zlib

TIMEOUT = 15.0  # seconds a version may take; a failed one fails everywhere within ~TIMEOUT + 2 * GRACE
GRACE = 2.0
WAIT = 120.0  # the test's own bound on any process's answer
STARTUP = 900.0  # … and on a process importing torch and the engine and building the model (minutes on a busy machine)
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def xfer_config(provider):
    return {
        "backend": "efa",
        "groups": [{"nics": ["auto"]}],
        "backends": {"efa": {"provider": provider}},
        "timeouts": {"transfer_ms": 20000, "connect_ms": 20000, "expect_ms": 60000},
        "worker": {"idle_poll_us": 0},
    }


def qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False, max_position_embeddings=256,
                       torch_dtype="bfloat16", architectures=["Qwen2ForCausalLM"])


def checkpoint_shapes():
    """The checkpoint's tensors: transformers' own Qwen2 (on the meta device), names and shapes."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(qwen2_config())
    return [(n, tuple(p.shape)) for n, p in model.named_parameters()]


def full_tensor(name, shape, seed):
    import torch

    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    return torch.randn(shape, generator=gen).to(torch.bfloat16)


def expected_parameter(name, checkpoint):
    """What the engine's parameter ``name`` holds after its ``load_weights`` took ``checkpoint``
    (HF name → tensor): q/k/v and gate/up concatenated into the fused parameters, the rest as sent."""
    import torch

    for fused, parts in FUSED.items():
        if f".{fused}." in name:
            return torch.cat([checkpoint[name.replace(fused, p)] for p in parts])
    return checkpoint[name]


def trainer(conn, url, group, shapes, provider, receivers=1):
    """A trainer rank: sends every checkpoint tensor of a version (seeded) to ``receivers``
    workers, optionally dying once the first ones are on their way, or with its last tensor in a
    shape the model does not take (transposed)."""
    from xfer.engine_weights import FullTensorSender

    largest = max(full_tensor(n, s, 0).numel() * 2 for n, s in shapes)
    # Two staging buckets of the largest tensor: the version goes out in several rounds, and
    # a round's bucket is refilled only after its previous writes completed.
    sender = FullTensorSender(rendezvous=url, group=group, receivers=receivers, config=xfer_config(provider),
                              timeout=TIMEOUT, grace=GRACE, budget_bytes=4 * largest)
    conn.send("up")
    last = shapes[-1][0]

    def dies_at_the_last_tensor(name, t):
        if name == last:
            os._exit(17)
        return t

    while True:
        cmd, arg = conn.recv()
        if cmd == "exit":
            sender.close()
            return
        version, seed, die, *rest = arg
        misshapen = bool(rest and rest[0])
        named = [(n, full_tensor(n, s, seed)) for n, s in shapes]
        if misshapen:
            name, t = named[-1]
            named[-1] = (name, t.t().contiguous())
        try:
            sender.send(version, named, transform=dies_at_the_last_tensor if die else None)
            conn.send(("ok", None))
        except Exception as e:  # noqa: BLE001
            conn.send(("failed", f"{type(e).__name__}: {e}"))


class Process:
    def __init__(self, ctx, target, *args):
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(there, *args))
        self.proc.start()

    def answer(self, patience=WAIT):
        if not self.conn.poll(patience):
            raise AssertionError(f"{self.proc.name} did not answer in {patience} s")
        return self.conn.recv()

    def ask(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        return self.answer()

    def close(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", None))
                self.answer()
            except (OSError, EOFError, AssertionError):
                pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
