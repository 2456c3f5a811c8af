"""The `blockwise` attention kernel: exact causal attention in O(T * block)
memory (Milakov & Gimelshein 2018, online softmax; Rabe & Staats 2021; Dao
et al. 2022, FlashAttention, and Dao 2023, FlashAttention-2, for the backward
pass). Queries and keys in blocks; a running max and sum per query row; key
blocks above the diagonal are never visited; a custom VJP stores only o and
the log-sum-exp and recomputes each block's probabilities in the backward
pass. Shapes as `jaxtp.model.kernels`: q [B, T, K, G, H], k, v [B, T, K, H].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ..parallel.collectives import vary, varying_axes, wide

NEG_INF = float("-inf")
# up to this many blocks (n (n + 1) / 2 block pairs) the loops are unrolled:
# static slices, no while loops (XLA's CPU backend runs 2 blocks of 64 at
# T = 128 in 0.8x the time of its loops, and compiles them faster)
UNROLL = 4


def scaled(q):
    """q / sqrt(H), folded into q (one pass over q, not over the T x T scores)."""
    return (q.astype(wide(q)) * q.shape[-1] ** -0.5).astype(q.dtype)


def causal(T: int, S: int, offset=0):
    """[T, S] bool, True where key s may be seen by query t (+ offset)."""
    return (jnp.arange(T)[:, None] + offset) >= jnp.arange(S)[None]


def blockwise_attention(q_BTKGH, k_BTKH, v_BTKH, block: int = 512):
    """Memory-efficient exact causal attention (see the module docstring)."""
    return _flash(q_BTKGH, k_BTKH, v_BTKH, block)


def blockwise_with_lse(q_BTKGH, k_BTKH, v_BTKH, block: int = 512):
    """(o [B, T, K, G, H], lse [B, K, G, T]) of the blockwise forward pass."""
    B, T, K, G, H = q_BTKGH.shape
    o, lse_nBKR = _flash_fwd(q_BTKGH, k_BTKH, v_BTKH, block)
    return o, _lse_out(lse_nBKR, B, K, G)[..., :T]


def _size(T: int, block: int) -> tuple[int, int]:
    """(block size b, number of blocks n) covering T."""
    b = min(block, T)
    return b, -(-T // b)


def _rows(x_BTKGH, b: int, n: int):
    """[B, T, K, G, H] -> [n, B, K, G*b, H], T zero-padded to n*b. Padded keys
    sit after every real query, so the causal mask hides them; padded query
    rows are dropped by `_unrows`."""
    B, T, K, G, H = x_BTKGH.shape
    x = jnp.pad(x_BTKGH, [(0, 0), (0, n * b - T), (0, 0), (0, 0), (0, 0)])
    return x.reshape(B, n, b, K, G, H).transpose(1, 0, 3, 4, 2, 5).reshape(n, B, K, G * b, H)


def _unrows(x_nBKRH, T: int, G: int):
    """The inverse of `_rows`."""
    n, B, K, R, H = x_nBKRH.shape
    b = R // G
    x = x_nBKRH.reshape(n, B, K, G, b, H).transpose(1, 0, 4, 2, 3, 5)
    return x.reshape(B, n * b, K, G, H)[:, :T]


def _kv_blocks(x_BTKH, b: int, n: int):
    return _rows(x_BTKH[:, :, :, None], b, n)  # [n, B, K, b, H]


def _unkv(x_nBKSH, T: int):
    return _unrows(x_nBKSH, T, 1)[:, :, :, 0]


def _diag_mask(G: int, b: int):
    """[G*b, b]: in a diagonal block, row r (query r % b) sees keys c <= r % b."""
    return jnp.tile(causal(b, b), (G, 1))


def _full(likes, shape, value):
    """A constant in the wide dtype of `likes` (`wide`) that varies over the
    manual axes any of `likes` varies over: inside a manual region a loop carry must
    keep one type, and what the loop adds to it varies with the inputs (over
    tp, for a rank's heads)."""
    return vary(jnp.full(shape, value, wide(jnp.result_type(*likes))),
                set().union(*map(varying_axes, likes)))


def _scores(q_BKRH, k_BKSH):
    return jnp.einsum("BKRH,BKSH->BKRS", q_BKRH, k_BKSH, preferred_element_type=wide(q_BKRH))


def _fold(lo, hi, visit, carry):
    """`fori_loop(lo, hi, visit, carry)`; unrolled where both bounds are Python
    ints (`UNROLL`: the blocks one by one, static slices)."""
    if isinstance(lo, int) and isinstance(hi, int):
        for i in range(lo, hi):
            carry = visit(i, carry)
        return carry
    return jax.lax.fori_loop(lo, hi, visit, carry)


def _scan(f, init, n: int, unroll: bool):
    """`lax.scan(f, init, arange(n))`, or with `unroll` over the Python ints
    0..n-1 (so `_fold`'s bounds stay static), outputs stacked."""
    if not unroll:
        return jax.lax.scan(f, init, jnp.arange(n))
    ys = []
    for i in range(n):
        init, y = f(init, i)
        ys.append(y)
    return init, jax.tree.map(lambda *a: jnp.stack(a), *ys)


def _flash_fwd(q_BTKGH, k_BTKH, v_BTKH, block, d=None):
    """(o like q, lse [n, B, K, G*b]): per query block, the diagonal key block
    (masked), then the blocks below it; never the ones above.

    `d` (a traced int): chunk mode, for context parallelism's parts. q and k
    are chunks of whole blocks (b = `chunk_block`) whose first positions are
    d blocks apart (q's minus k's), so that query block i's diagonal is key
    block d + i, which may lie before k (every key seen), past it (none: o
    is 0 and lse -inf) or in it; o is returned in fp32 for the caller's
    log-sum-exp merge."""
    B, T, K, G, H = q_BTKGH.shape
    chunk = d is not None
    b, n = (chunk_block(T, block), T // chunk_block(T, block)) if chunk else _size(T, block)
    nk = k_BTKH.shape[1] // b if chunk else n
    q, k, v = _rows(scaled(q_BTKGH), b, n), _kv_blocks(k_BTKH, b, nk), _kv_blocks(v_BTKH, b, nk)
    mask = _diag_mask(G, b)

    def query_block(i):
        q_i = q[i]

        def visit(j, carry, masked=False):
            m, l, acc = carry  # running max, sum of exp, weighted sum of v
            s = _scores(q_i, k[j])
            if masked:
                s = jnp.where(mask, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            pv = jnp.einsum("BKRS,BKSH->BKRH", p.astype(v.dtype), v[j],
                            preferred_element_type=wide(v))
            return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

        likes = (q_i, k, v)
        init = (_full(likes, q_i.shape[:3], NEG_INF), _full(likes, q_i.shape[:3], 0.0),
                _full(likes, q_i.shape, 0.0))
        if not chunk:
            carry = visit(i, init, masked=True)  # every row sees its own position: finite max
            m, l, acc = _fold(0, i, visit, carry)
            return (acc / l[..., None]).astype(q_BTKGH.dtype), m + jnp.log(l)
        diag = d + i
        carry = jax.lax.cond((diag >= 0) & (diag < nk),
                             lambda c: visit(jnp.clip(diag, 0, nk - 1), c, masked=True),
                             lambda c: c, init)
        m, l, acc = jax.lax.fori_loop(0, jnp.clip(diag, 0, nk), visit, carry)
        seen = l > 0  # rows of a query block wholly before k see no key
        l1 = jnp.where(seen, l, 1.0)
        return acc / l1[..., None], jnp.where(seen, m + jnp.log(l1), NEG_INF)

    _, (o, lse) = _scan(lambda c, i: (c, query_block(i)), None, n, not chunk and n <= UNROLL)
    return _unrows(o, T, G), lse


def chunk_block(c: int, block: int) -> int:
    """The block size of chunk mode: the largest divisor of a chunk of c
    positions not above `block` (chunks and their offsets are whole blocks)."""
    b = min(block, c)
    while c % b:
        b -= 1
    return b


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BTKGH, k_BTKH, v_BTKH, block):
    return _flash_fwd(q_BTKGH, k_BTKH, v_BTKH, block)[0]


def _flash_fwd_rule(q_BTKGH, k_BTKH, v_BTKH, block):
    o, lse = _flash_fwd(q_BTKGH, k_BTKH, v_BTKH, block)
    return o, (q_BTKGH, k_BTKH, v_BTKH, o, lse)  # O(T) per head: no T x T residual


def _flash_bwd(block, res, do_BTKGH):
    return _backward(block, res, do_BTKGH)


def _backward(block, res, do_BTKGH, dlse_BKGT=None, d=None):
    """FlashAttention-2's backward: per key block j, the query blocks i >= j
    recompute p = exp(s - lse); dv_j += p^T do, dk_j += ds^T q, dq_i += ds k_j,
    with ds = p * (do v^T - rowsum(do * o)). An lse cotangent (chunk mode)
    adds p * dlse to ds (d lse / d s = p): rowsum(do * o) - dlse in its place.
    Chunk mode (`d`, as `_flash_fwd`): key block j's diagonal is query block
    j - d; the query blocks after it see j whole."""
    q_BTKGH, k_BTKH, v_BTKH, o_BTKGH, lse = res
    B, T, K, G, H = q_BTKGH.shape
    chunk = d is not None
    b, n = (chunk_block(T, block), T // chunk_block(T, block)) if chunk else _size(T, block)
    nk = k_BTKH.shape[1] // b if chunk else n
    q, k, v = _rows(scaled(q_BTKGH), b, n), _kv_blocks(k_BTKH, b, nk), _kv_blocks(v_BTKH, b, nk)
    do = _rows(do_BTKGH.astype(q_BTKGH.dtype), b, n)
    delta = jnp.einsum("nBKRH,nBKRH->nBKR", do.astype(wide(do)),
                       _rows(o_BTKGH, b, n).astype(wide(do)))
    if dlse_BKGT is not None:
        delta -= dlse_BKGT.reshape(B, K, G, n, b).transpose(3, 0, 1, 2, 4).reshape(
            n, B, K, G * b)
    mask = _diag_mask(G, b)

    def key_block(dq, j):
        k_j, v_j = k[j], v[j]

        def visit(i, carry, masked=False):
            dq, dk_j, dv_j = carry
            p = jnp.exp(_scores(q[i], k_j) - lse[i][..., None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            dv_j += jnp.einsum("BKRS,BKRH->BKSH", p.astype(do.dtype), do[i],
                               preferred_element_type=wide(do))
            dp = jnp.einsum("BKRH,BKSH->BKRS", do[i], v_j, preferred_element_type=wide(do))
            ds = p * (dp - delta[i][..., None])
            dk_j += jnp.einsum("BKRS,BKRH->BKSH", ds.astype(q.dtype), q[i],
                               preferred_element_type=wide(do))
            dq_i = jnp.einsum("BKRS,BKSH->BKRH", ds.astype(k_j.dtype), k_j,
                              preferred_element_type=wide(do))
            return dq.at[i].add(dq_i), dk_j, dv_j

        zeros = _full((q, k, v, do), k_j.shape, 0.0)
        if not chunk:
            dq, dk_j, dv_j = _fold(j + 1, n, visit, visit(j, (dq, zeros, zeros), masked=True))
            return dq, (dk_j, dv_j)
        diag = j - d
        carry = jax.lax.cond((diag >= 0) & (diag < n),
                             lambda c: visit(jnp.clip(diag, 0, n - 1), c, masked=True),
                             lambda c: c, (dq, zeros, zeros))
        dq, dk_j, dv_j = jax.lax.fori_loop(jnp.clip(diag + 1, 0, n), n, visit, carry)
        return dq, (dk_j, dv_j)

    dq, (dk, dv) = _scan(key_block, _full((q, k, v, do), q.shape, 0.0), nk,
                         not chunk and n <= UNROLL)
    # the scores used q * H^-1/2: the chain rule scales dq by the same factor
    dq = _unrows(dq * H ** -0.5, T, G).astype(q_BTKGH.dtype)
    S = k_BTKH.shape[1]
    return dq, _unkv(dk, S).astype(k_BTKH.dtype), _unkv(dv, S).astype(v_BTKH.dtype)


_flash.defvjp(_flash_fwd_rule, _flash_bwd)


def _lse_out(lse_nBKR, B, K, G):
    """lse [n, B, K, G*b] -> [B, K, G, n*b]."""
    n, b = lse_nBKR.shape[0], lse_nBKR.shape[-1] // G
    return lse_nBKR.reshape(n, B, K, G, b).transpose(1, 2, 3, 0, 4).reshape(B, K, G, n * b)


def blockwise_chunk(q_BTKGH, k_BSKH, v_BSKH, q_start, k_start, block: int = 512):
    """(o fp32 [B, T, K, G, H], lse [B, K, G, T]) of queries at positions
    q_start + t over keys at k_start + s, causal (t + q_start >= s + k_start):
    one context-parallel part (`jaxtp.parallel.context`), differentiable in
    both outputs. T and S are whole blocks of `chunk_block(T, block)`, and
    so is q_start - k_start; key blocks wholly above the diagonal are never
    visited, so a part wholly above it costs nothing."""
    b = chunk_block(q_BTKGH.shape[1], block)
    if k_BSKH.shape[1] % b:
        raise ValueError(f"blockwise chunk: {k_BSKH.shape[1]} keys are not whole blocks of {b}")
    return _chunk(q_BTKGH, k_BSKH, v_BSKH, (q_start - k_start) // b, block)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _chunk(q_BTKGH, k_BSKH, v_BSKH, d, block):
    return _chunk_fwd(q_BTKGH, k_BSKH, v_BSKH, d, block)[0]


def _chunk_fwd(q_BTKGH, k_BSKH, v_BSKH, d, block):
    B, T, K, G, H = q_BTKGH.shape
    o, lse = _flash_fwd(q_BTKGH, k_BSKH, v_BSKH, block, d)
    return (o, _lse_out(lse, B, K, G)), (q_BTKGH, k_BSKH, v_BSKH, o, lse, d)


def _chunk_bwd(block, res, cotangents):
    *res, d = res
    do, dlse = cotangents
    return _backward(block, tuple(res), do, dlse, d) + (None,)


_chunk.defvjp(_chunk_fwd, _chunk_bwd)
