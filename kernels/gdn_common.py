"""Argument checks and small helpers shared by the GDN / KDA kernels.

Shapes (packed varlen tokens, see docs/layout.md):
    q, k        [T, Hk, K]
    v           [T, HV, V]      HV % Hk == 0; value head h reads key head h // (HV // Hk)
    g           [T, HV]         GDN: scalar log decay per head
                [T, HV, K]      KDA: per-key-channel log decay
    beta        [T, HV]
    state_pool  [N, HV, K, V]   fp32 or bf16; only rows named by `slots` are read
    slots       [B]             int64; < 0 means a fresh request (zero initial state)
    cu_seqlens  [B+1]           int32
"""

import torch

from ._triton import next_pow2


def _shape(x):
    return tuple(x.shape)


def _fail(name, expected, x):
    raise ValueError(f"{name}: expected {expected}, got shape {_shape(x)} dtype {x.dtype}")


def check_varlen(slots, cu_seqlens, T, device):
    """Check slots [B] / cu_seqlens [B+1] and return B."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype != torch.int32:
        _fail("cu_seqlens", "[B+1] int32", cu_seqlens)
    B = cu_seqlens.numel() - 1
    if slots.dim() != 1 or slots.numel() != B or slots.dtype not in (torch.int32, torch.int64):
        _fail("slots", f"[{B}] int64 (one per request of cu_seqlens)", slots)
    for name, x in (("slots", slots), ("cu_seqlens", cu_seqlens)):
        if x.device != device:
            raise ValueError(f"{name}: expected device {device}, got {x.device}")
    return B


def check_gated_delta_args(q, k, v, g, beta, state_pool, slots, cu_seqlens):
    """Validate shapes of the gated delta rule inputs.

    Returns (T, Hk, HV, K, V, B, is_kda).
    """
    if q.dim() != 3:
        _fail("q", "[T, Hk, K]", q)
    T, Hk, K = q.shape
    if _shape(k) != (T, Hk, K):
        _fail("k", f"[T, Hk, K] = {(T, Hk, K)} like q", k)
    if v.dim() != 3 or v.shape[0] != T:
        _fail("v", f"[T={T}, HV, V]", v)
    HV, V = v.shape[1], v.shape[2]
    if Hk == 0 or HV % Hk != 0:
        raise ValueError(f"v: expected HV to be a multiple of Hk={Hk}, got HV={HV}")
    if _shape(g) == (T, HV):
        is_kda = False
    elif _shape(g) == (T, HV, K):
        is_kda = True
    else:
        _fail("g", f"[T, HV] = {(T, HV)} (GDN) or [T, HV, K] = {(T, HV, K)} (KDA)", g)
    if _shape(beta) != (T, HV):
        _fail("beta", f"[T, HV] = {(T, HV)}", beta)
    if state_pool.dim() != 4 or _shape(state_pool)[1:] != (HV, K, V):
        _fail("state_pool", f"[N, HV, K, V] with (HV, K, V) = {(HV, K, V)}", state_pool)
    if not state_pool.is_floating_point():
        _fail("state_pool", "a float tensor", state_pool)
    if K > 256 or V > 512:
        raise ValueError(f"head dims: expected K <= 256 and V <= 512, got K={K}, V={V}")
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta), ("state_pool", state_pool)):
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device}, got {x.device}")
    B = check_varlen(slots, cu_seqlens, T, q.device)
    return T, Hk, HV, K, V, B, is_kda


def check_out(name, out, shape, device):
    if _shape(out) != tuple(shape) or not out.is_floating_point():
        _fail(name, f"float tensor of shape {tuple(shape)}", out)
    if out.device != device:
        raise ValueError(f"{name}: expected device {device}, got {out.device}")


def state_outputs(out_states, out_rows, rows, HV, K, V, state_pool, device, what):
    """Where a kernel's ``rows`` new states go ``-> out_states``: a fresh [rows, HV, K, V] tensor in the pool's
    dtype, the caller's ``out_states`` of that shape, or with ``out_rows`` [rows] a caller's pool whose rows
    ``out_rows`` names (``what``: what one row of out_rows is, for the message)."""
    if out_rows is not None:
        if out_states is None:
            raise ValueError("out_rows: given without out_states (the pool its rows index)")
        if out_rows.dim() != 1 or out_rows.shape[0] != rows or out_rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"out_rows: expected [{rows}] int64 (one row per {what}), "
                             f"got shape {tuple(out_rows.shape)} dtype {out_rows.dtype}")
        if out_rows.device != device:
            raise ValueError(f"out_rows: expected device {device}, got {out_rows.device}")
        check_out("out_states", out_states, (out_states.shape[0], HV, K, V), device)
        return out_states
    if out_states is None:
        return torch.empty(rows, HV, K, V, dtype=state_pool.dtype, device=device)
    check_out("out_states", out_states, (rows, HV, K, V), device)
    return out_states


def inner_contiguous(x):
    """Keep row/head strides (views of a fused projection stay views) but need a unit last stride."""
    return x if x.stride(-1) == 1 else x.contiguous()


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2) + eps) along the last dim, computed in fp32, returned in x.dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def value_heads(q, k, HV, use_qk_l2norm):
    """q, k [T, Hk, K] -> fp32 [T, HV, K] (l2-normalised first when asked): value head h
    reads key head h // (HV // Hk). For the torch references."""
    if use_qk_l2norm:
        q, k = l2norm(q.float()), l2norm(k.float())
    group = HV // q.shape[1]
    return q.float().repeat_interleave(group, dim=1), k.float().repeat_interleave(group, dim=1)


def start_state(state_pool, slot):
    """fp32 initial state [HV, K, V] of a request: its pool row, or zeros for slot < 0."""
    if slot >= 0:
        return state_pool[slot].float()
    return torch.zeros(state_pool.shape[1:], dtype=torch.float32, device=state_pool.device)


def pow2(n, lo=16):
    """Block size for a dim: tl.dot wants >= 16 and powers of two."""
    return max(lo, next_pow2(n))


def cdiv(a, b):
    return -(-int(a) // int(b))


def dot_precision(dtype):
    """fp32 activations get 3xTF32 dots (plain tf32 would break fp32 parity, ieee needs too
    much shared memory for the state tile); 16-bit operands keep triton's default."""
    return "tf32x3" if dtype == torch.float32 else None
