"""The pieces of a paged attention walk (Triton): scores, the online softmax, key/value tiles from the paged
cache or the step's own rows, the invariant mode's walk over one token's keys, and the ordered merge of that
walk's splits. Scores and the running max are in log2 units (``exp2``); the LSE leaves in natural log."""

from ._triton import tl, triton

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def _tanh(x):
    # Portable across triton versions and the interpreter; exp overflow gives
    # the exact +-1 limits.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _scores(q, k, sm_scale, softcap, SOFTCAP: tl.constexpr, IEEE: tl.constexpr):
    # q [BM, D_PAD], k [BN, D_PAD] -> scores [BM, BN] in log2 units
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k))
    s = qk * sm_scale
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return s * LOG2E


@triton.jit
def _online_update(s, v, m_i, l_i, acc, IEEE: tl.constexpr):
    # A row can be fully masked in a tile (window, padding rows); keep exp2
    # away from (-inf) - (-inf).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def cached_kv(K_CACHE, V_CACHE, BLOCK_TABLE, b, sbt_b, j, mask, kvh, d, dv, d_ok, dv_ok,
              skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, PAGE: tl.constexpr):
    # keys [BN, D_PAD] and values [BN, DV_PAD] of request b's cached positions j, through its block table;
    # rows outside ``mask`` load zeros
    page = tl.load(BLOCK_TABLE + b * sbt_b + j // PAGE, mask=mask, other=0).to(tl.int64)
    off = j % PAGE
    k = tl.load(K_CACHE + page[:, None] * skc_p + off[:, None] * skc_s + kvh * skc_h + d[None, :],
                mask=mask[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V_CACHE + page[:, None] * svc_p + off[:, None] * svc_s + kvh * svc_h + dv[None, :],
                mask=mask[:, None] & dv_ok[None, :], other=0.0)
    return k, v


@triton.jit
def fresh_kv(K_NEW, V_NEW, rows, mask, kvh, d, dv, d_ok, dv_ok, skn_t, skn_h, svn_t, svn_h):
    # keys and values of the step's own token rows; rows outside ``mask`` load zeros
    k = tl.load(K_NEW + rows[:, None] * skn_t + kvh * skn_h + d[None, :], mask=mask[:, None] & d_ok[None, :],
                other=0.0)
    v = tl.load(V_NEW + rows[:, None] * svn_t + kvh * svn_h + dv[None, :], mask=mask[:, None] & dv_ok[None, :],
                other=0.0)
    return k, v


@triton.jit
def attend_tile(q, k, v, j, visible, pos, m_i, l_i, acc, sm_scale, softcap, window,
                SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
    # one key tile into the online softmax: the scores, masked to the keys each row sees (and its window)
    s = _scores(q, k, sm_scale, softcap, SOFTCAP, IEEE)
    if WINDOW:
        visible = visible & (pos[:, None] - j[None, :] < window)
    s = tl.where(visible, s, float("-inf"))
    return _online_update(s, v, m_i, l_i, acc, IEEE)


@triton.jit
def invariant_keys(q, pos, ctx, lo, hi, b, tok0, kvh, d, dv, d_ok, dv_ok, n_off,
                   K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale, softcap, window,
                   skn_t, skn_h, svn_t, svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, sbt_b,
                   m_i, l_i, acc, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOW: tl.constexpr, IEEE: tl.constexpr):
    # The invariant mode's walk over one token's keys: tiles [i * BLOCK_N, (i + 1) * BLOCK_N) whatever the step's
    # other tokens (`invariant_tile`).
    for start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        m_i, l_i, acc = invariant_tile(start, q, pos, ctx, lo, hi, b, tok0, kvh, d, dv, d_ok, dv_ok, n_off,
                                       K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale, softcap, window,
                                       skn_t, skn_h, svn_t, svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, sbt_b,
                                       m_i, l_i, acc, PAGE, BLOCK_N, SOFTCAP, WINDOW, IEEE)
    return m_i, l_i, acc


@triton.jit
def invariant_splits(q, pos, ctx, lo, hi, b, tok0, kvh, d, dv, d_ok, dv_ok, n_off,
                     K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale, softcap, window,
                     skn_t, skn_h, svn_t, svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, sbt_b,
                     m_i, l_i, acc, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_KEYS: tl.constexpr,
                     SOFTCAP: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr):
    # Every split of [lo, hi) in one program: `invariant_keys` over each split of SPLIT_KEYS positions from a
    # fresh softmax, each merged into the running sums in order (`ordered_merge`), the bits of the splits run
    # as programs of their own and merged by a second launch. One loop over the tiles, not a loop a split: a
    # split of two or three tiles would leave the loads nothing to overlap with.
    first = (lo // BLOCK_N) * BLOCK_N
    m_s = tl.zeros_like(m_i) - float("inf")
    l_s = tl.zeros_like(l_i)
    acc_s = tl.zeros_like(acc)
    for start in range(first, hi, BLOCK_N):
        if (start % SPLIT_KEYS == 0) & (start > first):  # a split ends: its sums join the total, the next starts
            m_i, l_i, acc = ordered_merge(m_i, l_i, acc, m_s, l_s, acc_s, True)
            m_s = tl.zeros_like(m_i) - float("inf")
            l_s = tl.zeros_like(l_i)
            acc_s = tl.zeros_like(acc)
        m_s, l_s, acc_s = invariant_tile(start, q, pos, ctx, lo, hi, b, tok0, kvh, d, dv, d_ok, dv_ok, n_off,
                                         K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale, softcap, window,
                                         skn_t, skn_h, svn_t, svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h,
                                         sbt_b, m_s, l_s, acc_s, PAGE, BLOCK_N, SOFTCAP, WINDOW, IEEE)
    return ordered_merge(m_i, l_i, acc, m_s, l_s, acc_s, True)


@triton.jit
def invariant_tile(start, q, pos, ctx, lo, hi, b, tok0, kvh, d, dv, d_ok, dv_ok, n_off,
                   K_NEW, V_NEW, K_CACHE, V_CACHE, BLOCK_TABLE, sm_scale, softcap, window,
                   skn_t, skn_h, svn_t, svn_h, skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, sbt_b,
                   m_i, l_i, acc, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
                   WINDOW: tl.constexpr, IEEE: tl.constexpr):
    # One tile of a token's keys in the invariant mode: each key read from the cache or from the step's own rows
    # by where it lives, and only the keys the token sees [lo, hi) are loaded (the rest enter the dot as zeros),
    # so a token's sums are the same operations on the same values in a decode, a verify and a prefill, beside
    # any other requests.
    j = start + n_off  # [BN]
    seen = (j >= lo) & (j < hi)
    cached = seen & (j < ctx)
    fresh = seen & (j >= ctx)
    k, v = cached_kv(K_CACHE, V_CACHE, BLOCK_TABLE, b, sbt_b, j, cached, kvh, d, dv, d_ok, dv_ok,
                     skc_p, skc_s, skc_h, svc_p, svc_s, svc_h, PAGE)
    k_new, v_new = fresh_kv(K_NEW, V_NEW, tl.where(fresh, tok0 + j - ctx, 0).to(tl.int64), fresh, kvh,
                            d, dv, d_ok, dv_ok, skn_t, skn_h, svn_t, svn_h)
    k += k_new
    v += v_new
    return attend_tile(q, k, v, j, seen[None, :] & (j[None, :] <= pos[:, None]), pos, m_i, l_i, acc,
                       sm_scale, softcap, window, SOFTCAP, WINDOW, IEEE)


@triton.jit
def ordered_merge(m, den, acc, m_s, den_s, acc_s, LOG2: tl.constexpr):
    """The running ``(m, den, acc)`` of a token's walk and its next split's, in that order (``LOG2``: the maxima
    in log2 units). Each sum of two products is an explicit fma: where a compiler contracts ``x * a + y * b``
    is its choice, and the walk in one program and the launch that merges the splits' partial sums must not
    round it differently. From ``(-inf, 0, 0)`` the first split comes through exactly, and a split that saw
    no key (``-inf, 0, 0``) changes nothing, before or after the others."""
    m_new = tl.maximum(m, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if LOG2:
        a = tl.exp2(m - m_safe)
        b = tl.exp2(m_s - m_safe)
    else:
        a = tl.exp(m - m_safe)
        b = tl.exp(m_s - m_safe)
    return m_new, tl.fma(den_s, b, den * a), tl.fma(acc_s, b[:, None], acc * a[:, None])


@triton.jit
def normalized(m_i, l_i, acc, sink, HAS_SINK: tl.constexpr, LOG2: tl.constexpr):
    """A walk's sums divided out: ``-> (o [rows, Dv] fp32, lse [rows])``, the LSE in natural log without the
    sink (``LOG2``: the maxima in log2 units; ``sink``: log2 units, joins the denominator only, ``LOG2`` walks
    alone). With nothing attended the output stays 0 and the LSE is -inf."""
    attended = l_i > 0
    l_safe = tl.where(attended, l_i, 1.0)
    if LOG2:
        lse = tl.where(attended, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
    else:
        lse = tl.where(attended, m_i + tl.log(l_safe), float("-inf"))
    denom = l_safe
    if HAS_SINK:
        m_safe = tl.where(attended, m_i, 0.0)
        denom = l_i + tl.exp2(sink - m_safe)
    return acc / denom[:, None], lse
