"""thor_tf.block_diagonal (split layouts, BlockDiagonal, KroneckerOperator, the products training
applies) and the general vec/mat/eye algebra of tests/algebra_reference.py, against NumPy einsum /
kron references in float64."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import algebra_reference as A
from thor_tf import block_diagonal

RTOL = 1e-10
ATOL = 1e-12


def rng(seed=0):
    return np.random.default_rng(seed)


def t(a):
    return tf.constant(a, dtype=tf.float64)


def close(x, ref, rtol=RTOL, atol=ATOL):
    x = x.numpy() if hasattr(x, "numpy") else np.asarray(x)
    np.testing.assert_allclose(x, ref, rtol=rtol, atol=atol)


def row_major_vec(x):
    return np.asarray(x).reshape(-1)


# ---------------------------------------------------------------------------
# eye / tensor_prod / tensor_transuvection
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3,), (2, 3), (2, 1, 3), ()])
def test_eye(shape):
    e = A.eye(shape, dtype=tf.float64)
    assert e.dtype == tf.float64
    assert tuple(e.shape) == tuple(shape) + tuple(shape)
    n = int(np.prod(shape))
    ref = np.eye(n).reshape(tuple(shape) + tuple(shape))
    close(e, ref)
    # identity operator acts as identity
    if shape:
        x = rng(1).normal(size=shape)
        close(A.tensor_transuvection(e, t(x), "right"), x)


def test_eye_default_dtype_and_int():
    e = A.eye(4)
    assert e.dtype == tf.float32 and tuple(e.shape) == (4, 4)


def test_tensor_prod():
    r = rng(2)
    x = r.normal(size=(2, 3, 4))
    y = r.normal(size=(3, 2, 2))
    out = A.tensor_prod(t(x), t(y))
    assert tuple(out.shape) == (2, 3, 4, 3, 2, 2)
    close(out, np.einsum("ijk,uvw->ijkuvw", x, y))
    # scalars / vectors
    close(A.tensor_prod(t(2.0), t(y)), 2.0 * y)
    close(A.tensor_prod(t(x[0, 0]), t(y[0, 0])), np.outer(x[0, 0], y[0, 0]))


def test_transuvection_all():
    r = rng(3)
    x = r.normal(size=(2, 3, 4))
    y = r.normal(size=(2, 3, 4))
    out = A.tensor_transuvection(t(x), t(y), "all")
    assert out.shape.rank == 0
    close(out, np.sum(x * y))
    with pytest.raises(ValueError):
        A.tensor_transuvection(t(x), t(y[:1]), "all")


def test_transuvection_right():
    r = rng(4)
    # U^{uvw}_{ijk} . V_{uvw} = T_{ijk}
    u = r.normal(size=(2, 3, 4, 3, 2, 2))
    v = r.normal(size=(3, 2, 2))
    close(A.tensor_transuvection(t(u), t(v), "right"), np.einsum("ijkuvw,uvw->ijk", u, v))
    # matrix-vector
    m = r.normal(size=(5, 4))
    x = r.normal(size=(4,))
    close(A.tensor_transuvection(t(m), t(x), "right"), m @ x)
    # y with fewer axes than half of x
    close(A.tensor_transuvection(t(u), t(v[0, 0]), "right"), np.einsum("ijkuvw,w->ijkuv", u, v[0, 0]))
    with pytest.raises(ValueError):
        A.tensor_transuvection(t(m), t(r.normal(size=(5,))), "right")
    with pytest.raises(ValueError):
        A.tensor_transuvection(t(x), t(m), "right")


def test_transuvection_auto():
    r = rng(5)
    x = r.normal(size=(2, 3, 4, 3, 2, 2))
    y = r.normal(size=(3, 2, 2, 5, 1))
    # default axes = x.ndim // 2 = 3
    close(A.tensor_transuvection(t(x), t(y), "auto"), np.einsum("ijkuvw,uvwab->ijkab", x, y))
    # explicit axes
    y2 = r.normal(size=(2, 2, 3))
    close(
        A.tensor_transuvection(t(x), t(y2), "auto", axes=2),
        np.einsum("ijkuvw,vwa->ijkua", x, y2),
    )
    y1 = r.normal(size=(2, 4))
    close(A.tensor_transuvection(t(x), t(y1), "auto", axes=1), np.einsum("ijkuvw,wa->ijkuva", x, y1))
    # axes=0 is the outer product
    close(A.tensor_transuvection(t(x[0, 0, 0, 0]), t(y1), "auto", axes=0), np.einsum("ab,cd->abcd", x[0, 0, 0, 0], y1))
    # matrix product
    a, b = r.normal(size=(3, 4)), r.normal(size=(4, 2))
    close(A.tensor_transuvection(t(a), t(b), "auto"), a @ b)
    with pytest.raises(ValueError):
        A.tensor_transuvection(t(x), t(r.normal(size=(3, 3, 2))), "auto")
    with pytest.raises(ValueError):
        A.tensor_transuvection(t(a), t(b), "auto", axes=3)


def test_bad_mode_raises():
    x = t(np.ones((2, 2)))
    for fn in (
        lambda: A.tensor_transuvection(x, x, mode="left"),
        lambda: A.vec_inner_prod([x], [x], mode="bogus"),
        lambda: A.mat_vec_prod([[x]], [x[0]], mode="bogus"),
        lambda: A.mat_mat_prod([[x]], [[x]], mode="bogus"),
    ):
        with pytest.raises(ValueError, match="mode"):
            fn()


# ---------------------------------------------------------------------------
# vec / mat level
# ---------------------------------------------------------------------------
def _vec(r, shapes):
    return [r.normal(size=s) for s in shapes]


SHAPES = [(3,), (2, 3), (2, 2, 2)]


def test_vec_outer_prod():
    r = rng(6)
    xs = _vec(r, SHAPES)
    ys = _vec(r, SHAPES[:2])
    m = A.vec_outer_prod([t(x) for x in xs], [t(y) for y in ys])
    assert len(m) == 3 and all(len(row) == 2 for row in m)
    for i in range(3):
        for j in range(2):
            close(m[i][j], np.multiply.outer(xs[i], ys[j]))
    m2 = A.vec_outer_prod([None, t(xs[1])], [t(ys[0])])
    assert m2[0][0] is None
    close(m2[1][0], np.multiply.outer(xs[1], ys[0]))


def test_vec_inner_prod_all():
    r = rng(7)
    xs, ys = _vec(r, SHAPES), _vec(r, SHAPES)
    out = A.vec_inner_prod([t(x) for x in xs], [t(y) for y in ys])
    close(out, sum(np.sum(x * y) for x, y in zip(xs, ys)))
    out = A.vec_inner_prod([t(xs[0]), None, t(xs[2])], [t(y) for y in ys], "all")
    close(out, np.sum(xs[0] * ys[0]) + np.sum(xs[2] * ys[2]))
    with pytest.raises(ValueError):
        A.vec_inner_prod([None, None], [t(ys[0]), t(ys[1])])
    with pytest.raises(ValueError):
        A.vec_inner_prod([t(xs[0])], [t(ys[0]), t(ys[1])])


def test_vec_inner_prod_right_and_auto():
    r = rng(8)
    out_shape = (2, 2)
    ops = [r.normal(size=out_shape + s) for s in SHAPES]
    xs = _vec(r, SHAPES)
    ref = sum(
        np.tensordot(o, x, axes=x.ndim) for o, x in zip(ops, xs)
    )
    close(A.vec_inner_prod([t(o) for o in ops], [t(x) for x in xs], "right"), ref)
    # auto: (2, 2) + S_k contracted with S_k + (3,) using explicit axes, then a square sum
    lefts = [r.normal(size=(2, 2) + s) for s in SHAPES]
    rights = [r.normal(size=s + (3,)) for s in SHAPES]
    for k, s in enumerate(SHAPES):
        close(
            A.tensor_transuvection(t(lefts[k]), t(rights[k]), "auto", axes=len(s)),
            np.tensordot(lefts[k], rights[k], axes=len(s)),
        )
    sq_l = [r.normal(size=(3, 2, 3, 2)) for _ in range(2)]
    sq_r = [r.normal(size=(3, 2, 4)) for _ in range(2)]
    close(
        A.vec_inner_prod([t(a) for a in sq_l], [t(b) for b in sq_r], "auto"),
        sum(np.einsum("ijuv,uvk->ijk", a, b) for a, b in zip(sq_l, sq_r)),
    )


def test_mat_vec_prod_with_none_blocks():
    r = rng(9)
    xs = _vec(r, SHAPES)
    n = len(SHAPES)
    mat_np = [[r.normal(size=SHAPES[i] + SHAPES[j]) for j in range(n)] for i in range(n)]
    zero = {(0, 1), (1, 0), (2, 0), (2, 1), (0, 2)}
    mat = [[None if (i, j) in zero else t(mat_np[i][j]) for j in range(n)] for i in range(n)]
    out = A.mat_vec_prod(mat, [t(x) for x in xs])
    assert len(out) == n
    for i in range(n):
        ref = sum(
            np.tensordot(mat_np[i][j], xs[j], axes=xs[j].ndim)
            for j in range(n)
            if (i, j) not in zero
        )
        assert tuple(out[i].shape) == SHAPES[i]
        close(out[i], ref)
    with pytest.raises(ValueError):
        A.mat_vec_prod([[None, None, None]], [t(x) for x in xs])
    with pytest.raises(ValueError):
        A.mat_vec_prod([[t(mat_np[0][0])]], [t(x) for x in xs])


def test_mat_mat_prod():
    r = rng(10)
    n = len(SHAPES)
    mx_np = [[r.normal(size=SHAPES[i] + SHAPES[j]) for j in range(n)] for i in range(n)]
    my_np = [[r.normal(size=SHAPES[i] + SHAPES[j]) for j in range(n)] for i in range(n)]
    zx = {(0, 1), (1, 2)}
    zy = {(1, 0), (2, 0), (0, 0)}  # column 0 of MY is only k=... all zero -> check None propagation
    mx = [[None if (i, j) in zx else t(mx_np[i][j]) for j in range(n)] for i in range(n)]
    my = [[None if (i, j) in zy else t(my_np[i][j]) for j in range(n)] for i in range(n)]
    out = A.mat_mat_prod(mx, my)
    for i in range(n):
        for j in range(n):
            terms = [
                np.tensordot(mx_np[i][k], my_np[k][j], axes=len(SHAPES[k]))
                for k in range(n)
                if (i, k) not in zx and (k, j) not in zy
            ]
            if not terms:
                assert out[i][j] is None
            else:
                close(out[i][j], sum(terms))
    assert all(out[i][0] is None for i in range(n))


def test_mat_mat_prod_explicit_axes():
    r = rng(19)
    # 1 x 2 mat (S=(2,)) times 2 x 1 mat (R=(4,)) with T_0=(3,), T_1=(2,2): no diagonal to infer from
    x0, x1 = r.normal(size=(2, 3)), r.normal(size=(2, 2, 2))
    y0, y1 = r.normal(size=(3, 4)), r.normal(size=(2, 2, 4))
    ref = np.einsum("su,ur->sr", x0, y0) + np.einsum("suv,uvr->sr", x1, y1)
    out = A.mat_mat_prod([[t(x0), t(x1)]], [[t(y0)], [t(y1)]], axes=[1, 2])
    close(out[0][0], ref)
    out = A.mat_mat_prod([[t(x0), None]], [[t(y0)], [t(y1)]], axes=1)
    close(out[0][0], x0 @ y0)
    with pytest.raises(ValueError):
        A.mat_mat_prod([[t(x0), t(x1)]], [[t(y0)], [t(y1)]], axes=[1])


def test_block_diagonal_mat_with_eye():
    r = rng(11)
    blocks = [A.eye(s, tf.float64) for s in SHAPES]
    m = A.block_diagonal_mat(blocks)
    for i in range(3):
        for j in range(3):
            assert (m[i][j] is None) == (i != j)
    xs = _vec(r, SHAPES)
    out = A.mat_vec_prod(m, [t(x) for x in xs])
    for o, x in zip(out, xs):
        close(o, x)
    # eye is neutral for mat_mat_prod
    mm = A.mat_mat_prod(m, m)
    for i in range(3):
        close(mm[i][i], A.eye(SHAPES[i], tf.float64).numpy())


# ---------------------------------------------------------------------------
# BlockDiagonal
# ---------------------------------------------------------------------------
def _np_block_diag(mat, d):
    """Reference: keep the diagonal d x d blocks of mat, zero elsewhere."""
    n = mat.shape[0]
    out = np.zeros_like(mat)
    for s in range(0, n, d):
        e = min(s + d, n)
        out[s:e, s:e] = mat[s:e, s:e]
    return out


@pytest.mark.parametrize("n,d", [(7, 3), (6, 3), (5, 8), (5, 5), (4, 1)])
def test_block_diagonal_from_dense(n, d):
    r = rng(12)
    m = r.normal(size=(n, n))
    m = m + m.T
    bd = A.BlockDiagonal.from_dense(t(m), d)
    de = min(d, n)
    nb = -(-n // de)
    assert bd.dim == n and bd.block_size == de and bd.num_blocks == nb
    assert tuple(bd.blocks.shape) == (nb, de, de)
    assert bd.dtype == tf.float64
    close(bd.to_dense(), _np_block_diag(m, de))
    blocks = bd.blocks.numpy()
    pad = nb * de - n
    if pad:
        last = blocks[-1]
        k = de - pad
        close(last[:k, :k], m[n - k:, n - k:])
        close(last[k:, k:], np.eye(pad))
        close(last[:k, k:], np.zeros((k, pad)))
        close(last[k:, :k], np.zeros((pad, k)))
        # padded blocks stay invertible
        inv = bd.inverse()
        close(inv.to_dense() @ bd.to_dense(), np.eye(n), rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("n,d", [(7, 3), (6, 2), (5, 8)])
def test_block_diagonal_matmul_rmatmul(n, d):
    r = rng(13)
    m = r.normal(size=(n, n))
    bd = A.BlockDiagonal.from_dense(t(m), d)
    ref = _np_block_diag(m, min(d, n))
    x = r.normal(size=(n, 4))
    close(bd.matmul(t(x)), ref @ x)
    xr = r.normal(size=(3, n))
    close(bd.rmatmul(t(xr)), xr @ ref)
    v = r.normal(size=(n,))
    close(bd.apply_right(t(v)), ref @ v)
    close(A.tensor_transuvection(bd, t(v), "right"), ref @ v)


def test_block_diagonal_garbage_padding_is_ignored():
    r = rng(14)
    n, d = 5, 3
    blocks = r.normal(size=(2, d, d))  # padding row/col of last block is garbage
    bd = A.BlockDiagonal(t(blocks), n)
    ref = np.zeros((n, n))
    ref[:3, :3] = blocks[0]
    ref[3:, 3:] = blocks[1][:2, :2]
    close(bd.to_dense(), ref)
    x = r.normal(size=(n, 2))
    close(bd.matmul(t(x)), ref @ x)
    close(bd.rmatmul(t(x.T)), x.T @ ref)
    other = A.BlockDiagonal(t(r.normal(size=(2, d, d))), n)
    comp = bd.compose(other)
    assert isinstance(comp, A.BlockDiagonal)
    close(comp.to_dense(), ref @ other.to_dense().numpy())
    with pytest.raises(ValueError):
        A.BlockDiagonal(t(blocks), 7)


def test_block_diagonal_float32():
    r = rng(15)
    m = r.normal(size=(5, 5)).astype(np.float32)
    bd = A.BlockDiagonal.from_dense(tf.constant(m), 2)
    assert bd.dtype == tf.float32
    x = r.normal(size=(5, 3)).astype(np.float32)
    out = bd.matmul(tf.constant(x))
    assert out.dtype == tf.float32
    np.testing.assert_allclose(out.numpy(), _np_block_diag(m, 2) @ x, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# KroneckerOperator
# ---------------------------------------------------------------------------
def _factors(r, p, q, kind):
    left = r.normal(size=(p, p))
    right = r.normal(size=(q, q))
    if kind == "dense":
        return t(left), t(right), left, right
    lb = A.BlockDiagonal.from_dense(t(left), 2)
    rb = A.BlockDiagonal.from_dense(t(right), 3)
    return lb, rb, lb.to_dense().numpy(), rb.to_dense().numpy()


@pytest.mark.parametrize("kind", ["dense", "blockdiag", "mixed"])
def test_kronecker_apply_right(kind):
    r = rng(16)
    p, q = 5, 4
    if kind == "mixed":
        lb, _, l_np, _ = _factors(r, p, q, "blockdiag")
        _, rt, _, r_np = _factors(r, p, q, "dense")
        left, right = lb, rt
    else:
        left, right, l_np, r_np = _factors(r, p, q, kind)
    op = A.KroneckerOperator(left, right, scale=0.5)
    x = r.normal(size=(p, q))
    got = op.apply_right(t(x))
    # (a) materialised 4-tensor
    dense = op.to_dense()
    assert tuple(dense.shape) == (p, q, p, q) == tuple(op.shape)
    t4 = 0.5 * np.einsum("iu,vj->ijuv", l_np, r_np)
    close(dense, t4)
    close(got, np.einsum("ijuv,uv->ij", t4, x))
    # (b) kron(left, right^T) @ vec(x) row-major
    ref = 0.5 * (np.kron(l_np, r_np.T) @ row_major_vec(x)).reshape(p, q)
    close(got, ref)
    close(got, 0.5 * l_np @ x @ r_np)
    # dispatch through tensor_transuvection
    close(A.tensor_transuvection(op, t(x), "right"), ref)
    y4 = r.normal(size=(p, q, p, q))
    close(A.tensor_transuvection(op, t(y4), "all"), np.sum(t4 * y4))


def test_kronecker_compose_and_auto():
    r = rng(17)
    p, q = 5, 4
    l1, r1, l1n, r1n = _factors(r, p, q, "blockdiag")
    l2, r2, l2n, r2n = _factors(r, p, q, "dense")
    a = A.KroneckerOperator(l1, r1, scale=2.0)
    b = A.KroneckerOperator(l2, r2)
    c = A.KroneckerOperator(A.BlockDiagonal.from_dense(t(l2n), 2), A.BlockDiagonal.from_dense(t(r2n), 3))
    ta = a.to_dense().numpy()
    for other in (b, c):
        comp = A.tensor_transuvection(a, other, "auto")
        assert isinstance(comp, A.KroneckerOperator)
        close(comp.to_dense(), np.einsum("ijuv,uvab->ijab", ta, other.to_dense().numpy()))
    assert isinstance(a.compose(c).left, A.BlockDiagonal)
    # auto with a dense y falls back to to_dense()
    y = r.normal(size=(p, q, 3))
    close(A.tensor_transuvection(a, t(y), "auto"), np.einsum("ijuv,uvk->ijk", ta, y))
    # mat_mat_prod keeps a single lazy term lazy, densifies sums
    m = A.mat_mat_prod([[a]], [[b]])
    assert isinstance(m[0][0], A.KroneckerOperator)
    m2 = A.mat_mat_prod([[a, a]], [[b], [b]])
    close(m2[0][0], 2 * np.einsum("ijuv,uvab->ijab", ta, b.to_dense().numpy()))


def test_kronecker_bad_shape():
    op = A.KroneckerOperator(t(np.eye(3)), t(np.eye(2)))
    with pytest.raises(ValueError):
        op.apply_right(t(np.ones((2, 3))))


def test_block_diag_kronecker_mat_vec_in_tf_function():
    r = rng(18)
    shapes = [(5, 4), (3, 2), (6,)]
    l0, r0, l0n, r0n = _factors(r, 5, 4, "blockdiag")
    l1n, r1n = r.normal(size=(3, 3)), r.normal(size=(2, 2))
    b2n = r.normal(size=(6, 6))
    ops = [
        A.KroneckerOperator(l0, r0, scale=0.25),
        A.KroneckerOperator(t(l1n), t(r1n)),
        t(b2n),  # dense operator for a vector variable
    ]
    mat = A.block_diagonal_mat(ops)
    xs = [r.normal(size=s) for s in shapes]

    @tf.function(reduce_retracing=True)
    def f(xs):
        return A.mat_vec_prod(mat, xs)

    out = f([t(x) for x in xs])
    close(out[0], 0.25 * l0n @ xs[0] @ r0n)
    close(out[1], l1n @ xs[1] @ r1n)
    close(out[2], b2n @ xs[2])

    # also with XLA, operators built inside the function from variables
    lv = tf.Variable(r.normal(size=(7, 7)))
    rv = tf.Variable(r.normal(size=(3, 3)))

    @tf.function(jit_compile=True)
    def g(x):
        op = A.KroneckerOperator(A.BlockDiagonal.from_dense(lv, 3).inverse(), rv)
        return A.mat_vec_prod(A.block_diagonal_mat([op]), [x])[0]

    x = r.normal(size=(7, 3))
    blk = _np_block_diag(lv.numpy(), 3)
    inv_ref = np.zeros_like(blk)
    for s in range(0, 7, 3):
        e = min(s + 3, 7)
        inv_ref[s:e, s:e] = np.linalg.inv(blk[s:e, s:e])
    close(g(t(x)), inv_ref @ x @ rv.numpy(), rtol=1e-8, atol=1e-9)



def test_training_products_equal_the_block_diagonal_mat_algebra_bitwise():
    # The inverse rule applies apply_blockwise / inner_product; they must give seed 000's
    # mat_vec_prod(block_diagonal_mat(.)) and vec_inner_prod(mode="all") to the bit (the training
    # step computed those before), in float32 as training runs and in float64, and the NumPy
    # float64 values.
    r = rng(19)
    shapes = [(5, 4), (7, 3), (2, 6)]
    lefts = [r.normal(size=(p, p)) for p, _ in shapes]
    rights = [r.normal(size=(q, q)) for _, q in shapes]
    scales = [0.5, 0.25, 2.0]
    xs = [r.normal(size=s) for s in shapes]
    refs = [c * _np_block_diag(lm, 2) @ x @ _np_block_diag(rm, 3)
            for c, lm, rm, x in zip(scales, lefts, rights, xs)]
    # Each entry is two short sums (blocks of 2 and 3) of products: ~4 roundings, 1e-5 in float32.
    for dtype, tol in ((tf.float64, 1e-12), (tf.float32, 1e-5)):
        ops = [block_diagonal.KroneckerOperator(
            block_diagonal.BlockDiagonal.from_dense(tf.constant(lm, dtype), 2),
            block_diagonal.BlockDiagonal.from_dense(tf.constant(rm, dtype), 3),
            scale=tf.constant(c, dtype)) for c, lm, rm in zip(scales, lefts, rights)]
        x = [tf.constant(v, dtype) for v in xs]
        got = block_diagonal.apply_blockwise(ops, x)
        want = A.mat_vec_prod(A.block_diagonal_mat(ops), x, mode="right")
        for g, w, ref in zip(got, want, refs):
            assert g.dtype == dtype and np.array_equal(g.numpy(), w.numpy())
            np.testing.assert_allclose(g.numpy(), ref, rtol=tol, atol=tol)
        inner = block_diagonal.inner_product(got, x)
        assert np.array_equal(inner.numpy(), A.vec_inner_prod(got, x, mode="all").numpy())
        # 53 products of entries each ~4 roundings off, summed: the error is bounded by
        # ~60·eps·Σ|terms| (3.6e-6 of Σ|terms| in float32), not by the value, which cancels
        # (0.66 against Σ|terms| 75: with oneDNN off 4.5e-6 off, 0.7 of the former rtol 1e-5).
        terms = sum(np.sum(np.abs(g * v)) for g, v in zip(refs, xs))
        np.testing.assert_allclose(inner.numpy(), sum(np.sum(g * v) for g, v in zip(refs, xs)),
                                   rtol=0, atol=tol * terms)
    with pytest.raises(ValueError, match="inner_product"):
        block_diagonal.inner_product([t(np.ones((2, 3)))], [t(np.ones((3, 2)))])
