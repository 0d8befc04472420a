"""Triton kernels of target_service.triton_ops (imported only when they are used: Triton reads
TRITON_INTERPRET when a kernel is defined, and CPU-only installs have no Triton).
See target_service/triton_ops.py for what each computes and target_service/torch_ops.py for the
torch op it must match."""

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    X,
    R,
    W,
    Y,
    S,
    stride_x,
    stride_r,
    stride_y,
    stride_s,
    N,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    x = tl.load(X + row * stride_x + cols, mask=m, other=0.0)
    if HAS_RES:  # s = residual + x, rounded to the activation dtype as torch's add is
        r = tl.load(R + row * stride_r + cols, mask=m, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(x.dtype)
        tl.store(S + row * stride_s + cols, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / N + eps)
    y = (xf * rstd).to(x.dtype)
    w = tl.load(W + cols, mask=m, other=0.0)
    tl.store(Y + row * stride_y + cols, (w.to(tl.float32) * y.to(tl.float32)).to(x.dtype), mask=m)


@triton.jit
def _norm_rope(x1, x2, W, c1, c2, s1, s2, eps, HALF: tl.constexpr):
    """RMSNorm over the head (two halves) then RoPE, rounding as the torch ops do."""
    dt = x1.dtype
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / (2 * HALF) + eps)
    half = tl.arange(0, HALF)
    w1 = tl.load(W + half).to(tl.float32)
    w2 = tl.load(W + HALF + half).to(tl.float32)
    n1 = (w1 * (f1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    n2 = (w2 * (f2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]; each product rounded
    o1 = ((n1 * c1).to(dt).to(tl.float32) + (-n2 * s1).to(dt).to(tl.float32)).to(dt)
    o2 = ((n2 * c2).to(dt).to(tl.float32) + (n1 * s2).to(dt).to(tl.float32)).to(dt)
    return o1, o2


@triton.jit
def qk_rope_kernel(
    QKV,
    QW,
    KW,
    COS,
    SIN,
    ROPE_POS,
    WSLOT,
    WPOS,
    QO,
    CK,
    CV,
    stride_qkv,
    stride_qo_m,
    stride_qo_h,
    stride_cs,
    stride_ch,
    stride_ct,
    stride_tab,
    eps,
    H: tl.constexpr,
    KV: tl.constexpr,
    HALF: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)  # head: q 0..H-1, k H..H+KV-1, v after
    half = tl.arange(0, HALF)
    base = QKV + m * stride_qkv + j * (2 * HALF)
    x1 = tl.load(base + half)
    x2 = tl.load(base + HALF + half)
    dt = x1.dtype
    pos = tl.load(ROPE_POS + m).to(tl.int64)
    c1 = tl.load(COS + pos * stride_tab + half).to(dt).to(tl.float32)
    c2 = tl.load(COS + pos * stride_tab + HALF + half).to(dt).to(tl.float32)
    s1 = tl.load(SIN + pos * stride_tab + half).to(dt).to(tl.float32)
    s2 = tl.load(SIN + pos * stride_tab + HALF + half).to(dt).to(tl.float32)
    slot = tl.load(WSLOT + m).to(tl.int64)
    wpos = tl.load(WPOS + m).to(tl.int64)
    if j < H:
        o1, o2 = _norm_rope(x1, x2, QW, c1, c2, s1, s2, eps, HALF)
        out = QO + m * stride_qo_m + j * stride_qo_h
        tl.store(out + half, o1)
        tl.store(out + HALF + half, o2)
    elif j < H + KV:
        o1, o2 = _norm_rope(x1, x2, KW, c1, c2, s1, s2, eps, HALF)
        out = CK + slot * stride_cs + (j - H) * stride_ch + wpos * stride_ct
        tl.store(out + half, o1)
        tl.store(out + HALF + half, o2)
    else:
        out = CV + slot * stride_cs + (j - H - KV) * stride_ch + wpos * stride_ct
        tl.store(out + half, x1)
        tl.store(out + HALF + half, x2)


@triton.jit
def attention_kernel(
    Q,
    CK,
    CV,
    SLOTS,
    QLIM,
    O,
    L,
    stride_qb,
    stride_ql,
    stride_qh,
    stride_ob,
    stride_ol,
    stride_oh,
    stride_cs,
    stride_ch,
    stride_ct,
    stride_limb,
    scale_log2,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)  # row r = query l * G + group g
    ql = rows // G
    h = kvh * G + rows % G
    ok = ql < L
    d = tl.arange(0, D)
    q = tl.load(
        Q + b * stride_qb + ql[:, None] * stride_ql + h[:, None] * stride_qh + d[None, :],
        mask=ok[:, None],
        other=0.0,
    )
    lim = tl.load(QLIM + b * stride_limb + ql, mask=ok, other=0).to(tl.int32)  # last visible key
    slot = tl.load(SLOTS + b).to(tl.int64)
    kb = CK + slot * stride_cs + kvh * stride_ch
    vb = CV + slot * stride_cs + kvh * stride_ch
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    hi = tl.max(lim, axis=0) + 1
    for start in range(0, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        live = n < hi
        k = tl.load(
            kb + n[:, None].to(tl.int64) * stride_ct + d[None, :], mask=live[:, None], other=0.0
        )
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(
            n[None, :] <= lim[:, None], s * scale_log2, float("-inf")
        )  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            vb + n[:, None].to(tl.int64) * stride_ct + d[None, :], mask=live[:, None], other=0.0
        )
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        O + b * stride_ob + ql[:, None] * stride_ol + h[:, None] * stride_oh + d[None, :],
        out.to(O.dtype.element_ty),
        mask=ok[:, None],
    )


@triton.jit
def silu_mul_kernel(GU, OUT, stride_gu, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    g = tl.load(GU + row * stride_gu + cols, mask=m, other=0.0)
    u = tl.load(GU + row * stride_gu + I + cols, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(OUT + row * stride_o + cols, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)
