"""Once-per-step state writes (Triton): one launch for every layer of a pool.

`scatter_kv` and `scatter_rows` are the only functions in `kernels/` that
write into their arguments (`cache` / `dst`, in place). Everything else
returns new tensors.

Indices < 0 are padding and are skipped; indices past the end are skipped as
well (never written) so a bad index cannot corrupt memory: validate indices
upstream where a device sync is acceptable. With duplicate indices, which
write wins is unspecified.
"""

import torch

from ._triton import next_pow2, require_triton, tl, triton


@triton.jit
def _scatter_rows_kernel(
    DST, INDEX, SRC, n_dst_rows, row_len,
    sd_l, sd_m, ss_l, ss_n,
    BLOCK: tl.constexpr,
):
    n = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    idx = tl.load(INDEX + n).to(tl.int64)
    if (idx < 0) | (idx >= n_dst_rows):
        return
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    e_ok = e < row_len
    row = tl.load(SRC + layer * ss_l + n.to(tl.int64) * ss_n + e, mask=e_ok)
    tl.store(DST + layer * sd_l + idx * sd_m + e, row, mask=e_ok)


@triton.jit
def _scatter_pair_kernel(
    DST_A, SRC_A, DST_B, SRC_B, INDEX, n_dst_rows, len_a, len_b,
    sda_l, sda_m, ssa_l, ssa_n, sdb_l, sdb_m, ssb_l, ssb_n,
    BLOCK: tl.constexpr,
):
    # K and V of a pool share their slots: one program writes a chunk of both rows.
    n = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    idx = tl.load(INDEX + n).to(tl.int64)
    if (idx < 0) | (idx >= n_dst_rows):
        return
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    a_ok = e < len_a
    a = tl.load(SRC_A + layer * ssa_l + n.to(tl.int64) * ssa_n + e, mask=a_ok)
    tl.store(DST_A + layer * sda_l + idx * sda_m + e, a, mask=a_ok)
    b_ok = e < len_b
    b = tl.load(SRC_B + layer * ssb_l + n.to(tl.int64) * ssb_n + e, mask=b_ok)
    tl.store(DST_B + layer * sdb_l + idx * sdb_m + e, b, mask=b_ok)


def _flat_rows(name, t, dims):
    """View t [L, M, *row] as [L, M, R] without copying (the write must land in t)."""
    try:
        flat = t.view(t.shape[0], t.shape[1], -1)
    except RuntimeError:
        raise ValueError(f"{name}: expected the row dims of [{dims}] to be contiguous, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}") from None
    if flat.shape[2] > 1 and flat.stride(2) != 1:
        raise ValueError(f"{name}: expected a unit stride on the last dim, got strides {t.stride()}")
    return flat


def _check_index(name, index, n, device):
    if not isinstance(index, torch.Tensor) or index.dim() != 1 or index.shape[0] != n:
        got = tuple(index.shape) if isinstance(index, torch.Tensor) else type(index).__name__
        raise ValueError(f"{name}: expected shape [N] = ({n},), got {got}")
    if index.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name}: expected dtype torch.int64 (or int32), got {index.dtype}")
    if index.device != device:
        raise ValueError(f"{name}: expected device {device}, got {index.device}")


def scatter_rows(dst, index, src):
    """dst[l, index[n]] = src[l, n] for every layer l, in place, in one launch.

    dst [L, M, *row]; index [N] int64 (< 0 skipped); src [L, N, *row] with
    dst's dtype. Used for recurrent / conv state slot writes. Returns dst.
    """
    require_triton()
    for name, t in (("dst", dst), ("src", src)):
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            raise ValueError(f"{name}: expected a tensor [L, M|N, *row], got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    L, M, row = dst.shape[0], dst.shape[1], tuple(dst.shape[2:])
    if src.shape[0] != L or tuple(src.shape[2:]) != row:
        raise ValueError(f"src: expected shape [L, N, *row] = ({L}, N, {', '.join(map(str, row))}), "
                         f"got {tuple(src.shape)}")
    if src.dtype != dst.dtype:
        raise ValueError(f"src: expected dtype {dst.dtype} (dst's), got {src.dtype}")
    if src.device != dst.device:
        raise ValueError(f"src: expected device {dst.device} (dst's), got {src.device}")
    N = src.shape[1]
    _check_index("index", index, N, dst.device)
    dst_f = _flat_rows("dst", dst, "L, M, *row")
    src_f = src.reshape(L, N, -1)
    if src_f.shape[2] > 1 and src_f.stride(2) != 1:
        src_f = src_f.contiguous()
    R = dst_f.shape[2]
    if N == 0 or L == 0 or R == 0:
        return dst
    block = min(next_pow2(R), 4096)
    grid = (N, L, triton.cdiv(R, block))
    _scatter_rows_kernel[grid](
        dst_f, index, src_f, M, R,
        dst_f.stride(0), dst_f.stride(1), src_f.stride(0), src_f.stride(1),
        BLOCK=block, num_warps=4,
    )
    return dst


def scatter_rows_pair(dst_a, dst_b, index, src_a, src_b):
    """`scatter_rows` of two tensors that share one index (a pool's K and V), in one launch.

    dst_a [L, M, *row_a], dst_b [L, M, *row_b]; src_a [L, N, *row_a], src_b
    [L, N, *row_b]; index [N] (< 0 skipped). Returns (dst_a, dst_b).
    """
    require_triton()
    for dst, src, name in ((dst_a, src_a, "a"), (dst_b, src_b, "b")):
        if dst.dim() < 2 or src.dim() < 2 or src.shape[0] != dst.shape[0] or src.shape[2:] != dst.shape[2:]:
            raise ValueError(f"src_{name}: expected shape [L, N, *row] matching dst_{name} {tuple(dst.shape)}, "
                             f"got {tuple(src.shape)}")
        if src.dtype != dst.dtype or src.device != dst.device:
            raise ValueError(f"src_{name}: expected {dst.dtype} on {dst.device} (dst_{name}'s), "
                             f"got {src.dtype} on {src.device}")
    if dst_a.shape[:2] != dst_b.shape[:2] or src_a.shape[1] != src_b.shape[1]:
        raise ValueError(f"dst_b/src_b: expected the same [L, M] and N as dst_a/src_a, got "
                         f"{tuple(dst_b.shape[:2])} vs {tuple(dst_a.shape[:2])}")
    L, M, N = dst_a.shape[0], dst_a.shape[1], src_a.shape[1]
    _check_index("index", index, N, dst_a.device)
    da, db = _flat_rows("dst_a", dst_a, "L, M, *row"), _flat_rows("dst_b", dst_b, "L, M, *row")
    sa, sb = src_a.reshape(L, N, -1), src_b.reshape(L, N, -1)
    if sa.shape[2] > 1 and sa.stride(2) != 1:
        sa = sa.contiguous()
    if sb.shape[2] > 1 and sb.stride(2) != 1:
        sb = sb.contiguous()
    R = max(da.shape[2], db.shape[2])
    if N == 0 or L == 0 or R == 0:
        return dst_a, dst_b
    block = min(next_pow2(R), 4096)
    grid = (N, L, triton.cdiv(R, block))
    _scatter_pair_kernel[grid](
        da, sa, db, sb, index, M, da.shape[2], db.shape[2],
        da.stride(0), da.stride(1), sa.stride(0), sa.stride(1),
        db.stride(0), db.stride(1), sb.stride(0), sb.stride(1),
        BLOCK=block, num_warps=4,
    )
    return dst_a, dst_b


def scatter_kv(cache, slot_mapping, new):
    """Write the step's K (or V) of every layer into a paged pool, in place, in one launch.

    cache [L, P, S, H, D] (any trailing row dims work, e.g. [L, P, S, R] for
    MLA latents); slot_mapping [N] int64 flat slots page * S + offset (< 0
    skipped); new [L, N, H, D] in cache's dtype. Returns cache.
    """
    if not isinstance(cache, torch.Tensor) or cache.dim() < 3:
        got = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise ValueError(f"cache: expected a tensor [L, P, S, H, D], got {got}")
    L, P, S = cache.shape[:3]
    if P > 1 and cache.stride(1) != S * cache.stride(2):
        raise ValueError(f"cache: expected pages of S={S} contiguous slots "
                         f"(stride(1) == S * stride(2)), got strides {cache.stride()}")
    slots = cache.view(L, P * S, *cache.shape[3:])  # [L, P*S, H, D]
    scatter_rows(slots, slot_mapping, new)
    return cache


def scatter_rows_ref(dst, index, src):
    """Reference for `scatter_rows` (also in place); returns dst."""
    keep = (index >= 0) & (index < dst.shape[1])
    dst[:, index[keep].long()] = src[:, keep]
    return dst


def scatter_kv_ref(cache, slot_mapping, new):
    """Reference for `scatter_kv` (also in place); returns cache."""
    L, P, S = cache.shape[:3]
    for n in range(slot_mapping.shape[0]):
        slot = int(slot_mapping[n])
        if 0 <= slot < P * S:
            cache[:, slot // S, slot % S] = new[:, n]
    return cache
