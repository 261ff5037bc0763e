"""An oracle for dispatch and combine that needs no communication: every rank regenerates
every rank's inputs from a seed, so each can compute what it must receive and what combine
must return, exactly.

Inputs are integer-valued (exact in bf16), expert ``e`` (logical) computes
``y = round_to_dtype(x · (e + 1))``, and weights are multiples of 1/8, so every product and
sum in fp32 is exact whatever the order: outputs are compared bit for bit."""

from __future__ import annotations

import numpy as np

from .layout import EpConfig, from_f32, to_f32

ROUTINGS = ("uniform", "incast", "zipf")


def physical_of(cfg: EpConfig, eplb, expert: int, token: int, slot: int) -> int:
    """The physical expert a slot goes to (the planner's rule: ``(token × top_k + slot) mod
    replicas``)."""
    if eplb is None:
        return expert
    replicas = [p for p in eplb[expert] if p >= 0]
    return replicas[(token * cfg.top_k + slot) % len(replicas)]


def logical_of_physical(cfg: EpConfig, eplb) -> np.ndarray:
    """Each physical expert's logical expert (``-1`` for one no logical expert uses)."""
    out = np.full(cfg.num_experts, -1, dtype=np.int64)
    if eplb is None:
        out[:] = np.arange(cfg.num_experts)
        return out
    for e, row in enumerate(eplb):
        for p in row:
            if p >= 0:
                out[p] = e
    return out


def inputs(seed: int, step: int, rank: int, cfg: EpConfig, *, routing: str = "uniform", tokens: int | None = None,
           logical_experts: int | None = None, drop: float = 0.1, empty_ranks=()):
    """Rank ``rank``'s inputs of step ``step``: ``(x [tokens, hidden] storage dtype, topk_idx
    [tokens, top_k] int64, topk_weights [tokens, top_k] float32)``."""
    rng = np.random.default_rng([seed, step, rank])
    experts = logical_experts if logical_experts is not None else cfg.num_experts
    n = cfg.max_tokens if tokens is None else tokens
    if rank in empty_ranks:
        n = 0
    x = from_f32(rng.integers(-8, 9, size=(n, cfg.hidden)).astype(np.float32), cfg.dtype)
    k = cfg.top_k
    idx = np.full((n, k), -1, dtype=np.int64)
    if routing == "uniform":
        p = None
    elif routing == "incast":
        # Every token of every rank names the same k experts (the first k): all incast.
        p = None
    elif routing == "zipf":
        p = 1.0 / np.arange(1, experts + 1) ** 1.2
        p = p / p.sum()
    else:
        raise ValueError(routing)
    for t in range(n):
        m = min(k, experts)
        if routing == "incast":
            picked = np.arange(m)
        else:
            picked = rng.choice(experts, size=m, replace=False, p=p)
        idx[t, :m] = picked
    if drop:
        idx[rng.random(idx.shape) < drop] = -1
    w = (rng.integers(1, 9, size=(n, k)) / 8.0).astype(np.float32)
    return x, idx, w


def expert_fn(rows: np.ndarray, logical: int, cfg: EpConfig) -> np.ndarray:
    """What logical expert ``logical`` computes on rows of the storage dtype."""
    return from_f32(to_f32(rows, cfg.dtype) * np.float32(logical + 1), cfg.dtype)


def run_experts_deepep(recv_x: np.ndarray, recv_count, rank: int, cfg: EpConfig, eplb=None) -> np.ndarray:
    """The experts of ``rank`` on DeepEP's layout (rows past the count left as they are)."""
    logical = logical_of_physical(cfg, eplb)
    out = recv_x.copy()
    for le in range(cfg.experts_per_rank):
        n = int(recv_count[le])
        out[le, :n] = expert_fn(recv_x[le, :n], int(logical[rank * cfg.experts_per_rank + le]), cfg)
    return out


def run_experts_flat(recv_x: np.ndarray, starts, rank: int, cfg: EpConfig, eplb=None) -> np.ndarray:
    logical = logical_of_physical(cfg, eplb)
    out = recv_x.copy()
    for le in range(cfg.experts_per_rank):
        a, b = int(starts[le]), int(starts[le + 1])
        out[a:b] = expert_fn(recv_x[a:b], int(logical[rank * cfg.experts_per_rank + le]), cfg)
    return out


def expected_recv(all_inputs, rank: int, cfg: EpConfig, eplb=None, active=None):
    """For each local expert of ``rank``: its rows in order (sources in rank order, each
    source's (token, slot) in order), from the active sources."""
    out = []
    for le in range(cfg.experts_per_rank):
        p = rank * cfg.experts_per_rank + le
        rows = []
        for s, (x, idx, _w) in enumerate(all_inputs):
            if active is not None and not active[s]:
                continue
            for t in range(idx.shape[0]):
                for j in range(cfg.top_k):
                    e = int(idx[t, j])
                    if e >= 0 and physical_of(cfg, eplb, e, t, j) == p:
                        rows.append(x[t])
        out.append(np.array(rows, dtype=cfg.storage).reshape(len(rows), cfg.hidden))
    return out


def expected_combine(x: np.ndarray, idx: np.ndarray, w: np.ndarray, cfg: EpConfig, eplb=None, active=None) -> np.ndarray:
    """``Σ_slot w · expert(x)`` in fp32, counting only slots whose rank is active."""
    n = idx.shape[0]
    y = np.zeros((n, cfg.hidden), dtype=np.float32)
    for t in range(n):
        for j in range(cfg.top_k):
            e = int(idx[t, j])
            if e < 0:
                continue
            rank = physical_of(cfg, eplb, e, t, j) // cfg.experts_per_rank
            if active is not None and not active[rank]:
                continue
            y[t] += np.float32(w[t, j]) * to_f32(expert_fn(x[t:t + 1], e, cfg), cfg.dtype)[0]
    return y


# -- fp8 dispatch: an independent reference of the quantization (numpy, no Rust) -------------


def e4m3_values() -> np.ndarray:
    """The float32 value of each of the 256 float8 e4m3fn codes (0x7f, 0xff: NaN)."""
    c = np.arange(256)
    exp, man = (c >> 3) & 0xF, (c & 7).astype(np.float64)
    mag = np.where(exp == 0, man * 2.0**-9, (1 + man / 8) * 2.0 ** (exp - 7))
    mag[(exp == 0xF) & ((c & 7) == 7)] = np.nan
    return (np.where(c & 0x80, -mag, mag)).astype(np.float32)


def encode_e4m3(y: np.ndarray) -> np.ndarray:
    """Nearest e4m3fn code of each float32 (ties to the even code), saturating at ±448."""
    pos = e4m3_values()[:0x7F]  # 0 .. 448, increasing
    a = np.minimum(np.abs(y), pos[-1])
    hi = np.clip(np.searchsorted(pos, a), 1, len(pos) - 1)
    lo = hi - 1
    dlo, dhi = a - pos[lo], pos[hi] - a
    code = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(a == pos[lo], lo, code)
    return (code | np.where(np.signbit(y), 0x80, 0)).astype(np.uint8)


def quantize_fp8(rows: np.ndarray, cfg: EpConfig) -> tuple[np.ndarray, np.ndarray]:
    """bf16 rows (as bits) quantized as ``cfg.fp8`` says: ``(codes [n, hidden] uint8,
    scales [n, blocks] float32)``."""
    block = 128
    x = to_f32(rows, "bfloat16")
    n, hidden = x.shape
    blocks = -(-hidden // block)
    codes = np.zeros((n, hidden), dtype=np.uint8)
    scales = np.zeros((n, blocks), dtype=np.float32)
    for b in range(blocks):
        part = x[:, b * block:(b + 1) * block]
        amax = np.maximum(np.abs(part).max(axis=1, initial=0), np.float32(1e-4)).astype(np.float32)
        if cfg.fp8 == "e4m3_pow2":
            e = np.ceil(np.log2(amax / np.float32(448))).astype(np.int32)
            scale, inv = np.ldexp(np.float32(1), e).astype(np.float32), np.ldexp(np.float32(1), -e).astype(np.float32)
        else:
            scale, inv = (amax / np.float32(448)).astype(np.float32), (np.float32(448) / amax).astype(np.float32)
        codes[:, b * block:(b + 1) * block] = encode_e4m3((part * inv[:, None]).astype(np.float32))
        scales[:, b] = scale
    return codes, scales


def dequantize_fp8(codes: np.ndarray, scales: np.ndarray, hidden: int) -> np.ndarray:
    """``value × scale`` per channel, float32."""
    return e4m3_values()[codes] * np.repeat(scales, 128, axis=-1)[..., :hidden]
