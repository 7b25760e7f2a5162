"""LoRA adapters (``layer.enable_lora(rank, lora_alpha)``): the A-side and B-side blocks against
float64 references built from first principles.

The anchor is the per-example gradient of each adapter, computed by central differences of the
per-example loss ``ℓ_n = mean_k (z_nk − y_nk)²`` in float64 (``ℓ`` is quadratic in each adapter,
so central differences are exact up to rounding), from an explicit forward pass
``z = einsum(eq, x, W + s·A·B) + b`` checked against Keras' own. The rows of each block (derived by
hand: A side ``a = x``, ``g = s·g·Bᵀ``; B side ``a = [s·x·A, 1]``, ``g = dℓ/dz``) must reproduce
those gradients (``Σ_rows a gᵀ = ∇ℓ_n``), THOR's factors must be their mean outer products and its
update ``(1/P)(A + dI)⁻¹ ∇ (G + dI)⁻¹``. Rows with the scale left out, squared, or with ``A`` and
``B`` in each other's place reproduce neither the gradients nor THOR's factors (the negative
checks). Nothing here is computed by the code under test.
"""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import thor_tf
from reference import (block_diagonal_part, einsum_rows, homogeneous, kfac_direction,
                       mean_outer)
from thor_tf.capture import Record

RANK, ALPHA = 2, 6.0  # s = alpha / rank = 3: a wrong scale is off by 3x
SCALE = ALPHA / RANK

# name: (equation, output_shape, bias_axes, input_shape); Dense is "abc,cd->abd" with bias "d".
CASES = {
    "dense": ("abc,cd->abd", None, "d", (3, 4)),
    "einsum_heads": ("abc,cde->abde", (3, 2, 3), "de", (3, 4)),          # MHA query/key/value
    "einsum_output": ("abcd,cde->abe", (3, 4), "e", (3, 2, 3)),          # MHA output
    "einsum_permuted": ("abc,dce->abde", (3, 2, 3), None, (3, 4)),       # heads before c
}


def _build(case, seed=3, quantize=None):
    equation, output_shape, bias_axes, input_shape = CASES[case]
    keras.utils.set_random_seed(seed)
    if case == "dense":
        layer = keras.layers.Dense(4, name="blk")  # in == out: A and B can trade places
    else:
        layer = keras.layers.EinsumDense(equation, output_shape, bias_axes=bias_axes, name="blk")
    model = keras.Sequential([keras.Input(input_shape), layer, keras.layers.Flatten()])
    if quantize:
        layer.quantize(quantize)
    layer.enable_lora(RANK, lora_alpha=ALPHA)
    rng = np.random.default_rng(seed)
    # Keras starts B at zero (A's G would be 0): random adapters, and a bias that is not zero.
    layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    if layer.bias is not None:
        layer.bias.assign(rng.normal(size=layer.bias.shape).astype("float32") * 0.1)
    x = rng.normal(size=(3,) + input_shape).astype("float32")
    return model, layer, x


def _axes(case):
    """``(inp, ker, out, positions, contracted, others, last)`` of the case's equation."""
    equation = CASES[case][0]
    inp, rest = equation.split(",")
    ker, out = rest.split("->")
    positions = [c for c in inp if c in out]
    contracted = [c for c in ker if c in inp]
    out_axes = [c for c in ker if c in out]
    return inp, ker, out, positions, contracted, out_axes[:-1], ker[-1]


def _params(layer):
    w = layer._kernel.numpy().astype(np.float64)
    a = layer.lora_kernel_a.numpy().astype(np.float64)
    b = layer.lora_kernel_b.numpy().astype(np.float64)
    bias = None if layer.bias is None else layer.bias.numpy().astype(np.float64)
    return w, a, b, bias


def _forward(case, x, w, a, b, bias):
    """``z = einsum(eq, x, W + s·(A @ B)) + bias``, float64 (Keras' LoRA forward)."""
    z = np.einsum(CASES[case][0], x, w + SCALE * np.matmul(a, b))
    return z if bias is None else z + bias


def _losses(case, x, y, params):
    z = _forward(case, x, *params)
    n = len(x)
    return np.mean((z.reshape(n, -1) - y) ** 2, axis=1)                 # ℓ_n, per example


def _per_example_grads(case, x, y, params, which, h=1e-3):
    """``[N, *shape]``: ∂ℓ_n/∂(param ``which``) by central differences (exact: ℓ is quadratic)."""
    params = [None if p is None else p.copy() for p in params]
    target = params[which]
    out = np.zeros((len(x),) + target.shape)
    for idx in np.ndindex(target.shape):
        old = target[idx]
        target[idx] = old + h
        up = _losses(case, x, y, params)
        target[idx] = old - h
        down = _losses(case, x, y, params)
        target[idx] = old
        out[(slice(None),) + idx] = (up - down) / (2 * h)
    return out


def _a_matrix(case, a):
    """A ``[c..., o'..., r]`` as ``[in, n_other, r]`` (explicit transposition)."""
    _, ker, _, _, contracted, others, _ = _axes(case)
    spec = ker[:-1] + "k"
    moved = np.transpose(a, [spec.index(c) for c in contracted + others + ["k"]])
    n_in = int(np.prod([a.shape[spec.index(c)] for c in contracted]))
    return moved.reshape(n_in, -1, a.shape[-1])


def _rows(case, x, g, params, variant="correct"):
    """Hand-derived rows ``(a_A, g_A, a_B, g_B)`` of one example set (module docstring), or a
    wrong variant of them."""
    inp, ker, out, positions, contracted, others, last = _axes(case)
    _, a, b, _ = params
    s = {"correct": SCALE, "scale_omitted": 1.0, "scale_squared": SCALE ** 2,
         "a_b_swapped": SCALE}[variant]
    x_rows = einsum_rows(x, inp, positions, contracted)                     # [R, in]
    g_rows = einsum_rows(g, out, positions, others + [last])               # [R, n_other·e]
    n_other = int(np.prod([g.shape[out.index(c)] for c in others]))
    g3 = g_rows.reshape(len(g_rows), n_other, -1)                          # [R, n_other, e]
    a3 = _a_matrix(case, a)                                                # [in, n_other, r]
    if variant == "a_b_swapped":  # A where Bᵀ belongs and Bᵀ where A belongs (in == out only)
        ga = s * np.einsum("roe,ek->rok", g3, a3[:, 0, :])
        u = s * np.einsum("rc,kc->rk", x_rows, b)[:, None, :]
    else:
        ga = s * np.einsum("roe,ke->rok", g3, b)                            # s·g·Bᵀ
        u = s * np.einsum("rc,cok->rok", x_rows, a3)                        # s·x·A
    return (x_rows, ga.reshape(len(ga), -1),
            u.reshape(-1, u.shape[-1]), g3.reshape(-1, g3.shape[-1]))


def _b_folded(case):
    _, _, _, _, _, others, last = _axes(case)
    return CASES[case][2] == last and not others


def _setup(case):
    model, layer, x = _build(case)
    params = _params(layer)
    x64 = x.astype(np.float64)
    z = _forward(case, x64, *params)
    np.testing.assert_allclose(model(x).numpy(), z.reshape(len(x), -1), rtol=1e-5, atol=1e-5)
    n, k = len(x), int(np.prod(z.shape[1:]))
    y = np.random.default_rng(7).normal(size=(n, k))
    g = (2.0 * (z.reshape(n, -1) - y) / k).reshape(z.shape)                 # dℓ_n/dz
    return model, layer, x, x64, y, g, params


def _example_sums(rows_a, rows_g, n):
    """``Σ_rows of example n`` a gᵀ, ``[N, a_dim, g_dim]`` (rows are example-major)."""
    per = len(rows_a) // n
    return np.stack([rows_a[i * per:(i + 1) * per].T @ rows_g[i * per:(i + 1) * per]
                     for i in range(n)])


def _grad_matrices(case, x64, y, params):
    """Per-example FD gradients as block matrices: A side ``[N, in, n_other·r]``, B side
    ``[N, r(+1), e]`` (bias gradient as the last row when folded)."""
    n = len(x64)
    grad_a = _per_example_grads(case, x64, y, params, 1)
    grad_b = _per_example_grads(case, x64, y, params, 2)
    mat_a = np.stack([_a_matrix(case, ga).reshape(_a_matrix(case, ga).shape[0], -1)
                      for ga in grad_a])
    mat_b = grad_b
    if _b_folded(case):
        grad_bias = _per_example_grads(case, x64, y, params, 3).reshape(n, 1, -1)
        mat_b = np.concatenate([grad_b, grad_bias], axis=1)
    return mat_a, mat_b


@pytest.mark.update_rule("inverse")  # the update checked is THOR's inverse (natural-gradient) step
@pytest.mark.parametrize("case,split", [(c, 64) for c in sorted(CASES)]
                         + [("dense", 2), ("einsum_heads", 2)])
def test_lora_blocks_factors_traces_and_update_match_first_principles(case, split):
    """``split`` 2: every factor larger than 2 is stored and inverted as its 2×2 diagonal blocks
    (the split inverse), as for any block."""
    model, layer, x, x64, y, g, params = _setup(case)
    n = len(x)
    a_a, g_a, a_b, g_b = _rows(case, x64, g, params)
    a_b = homogeneous(a_b, _b_folded(case))
    mat_a, mat_b = _grad_matrices(case, x64, y, params)
    # The hand-derived rows reproduce the per-example gradients of both adapters.
    np.testing.assert_allclose(_example_sums(a_a, g_a, n), mat_a, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_example_sums(a_b, g_b, n), mat_b, rtol=1e-6, atol=1e-9)

    lam = 0.1
    p_a, p_b = len(a_a) // n, len(a_b) // n                 # rows per example of each block
    w0, a0, b0, bias0 = params
    wrapped = thor_tf.wrap(model, learning_rate=1.0, momentum=0.0, damping=lam, kl_clip=None,
                           split_dim=split, verbose=False)
    names = [b.name for b in wrapped.thor.blocks]
    assert names == ["blk/lora_a", "blk/lora_b"]
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(x, y.astype("float32"))

    got_a, got_b = wrapped.thor.factors("blk/lora_a"), wrapped.thor.factors("blk/lora_b")
    np.testing.assert_allclose(got_a["A"], block_diagonal_part(mean_outer(a_a), split),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_a["G"], block_diagonal_part(mean_outer(g_a), split),
                               rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(got_b["A"], block_diagonal_part(mean_outer(a_b), split),
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_b["G"], block_diagonal_part(mean_outer(g_b), split),
                               rtol=1e-4, atol=1e-9)

    # The update of each adapter: (1/P)(A + dI)⁻¹ ∇ (G + dI)⁻¹ of the mean loss's gradient.
    w1, a1, b1, bias1 = _params(layer)
    np.testing.assert_array_equal(w1, w0)                   # the frozen kernel: untouched
    step_a = kfac_direction(a_a, g_a, mat_a.mean(axis=0), lam, positions=p_a, split_dim=split)
    step_b = kfac_direction(a_b, g_b, mat_b.mean(axis=0), lam, positions=p_b, split_dim=split)
    moved_a = _a_matrix(case, a0 - a1).reshape(step_a.shape)
    np.testing.assert_allclose(moved_a, step_a, rtol=2e-3, atol=1e-6)
    moved_b = b0 - b1
    if _b_folded(case):
        moved_b = np.concatenate([moved_b, (bias0 - bias1).reshape(1, -1)], axis=0)
    np.testing.assert_allclose(moved_b, step_b, rtol=2e-3, atol=1e-6)

    # Cheap traces and rows per example, on the step's input (before the update: fresh layer).
    model2, layer2, _ = _build(case)
    blocks = thor_tf.wrap(model2, verbose=False).thor.candidates
    record = Record(tf.constant(x), tf.constant(_forward(case, x64, *params), tf.float32))
    gt = [tf.constant(g, tf.float32)]
    for block, (ra, rg, p) in zip(blocks, ((a_a, g_a, p_a), (a_b, g_b, p_b))):
        assert float(block.trace_a([record])) == pytest.approx(np.trace(mean_outer(ra)), rel=1e-5)
        assert float(block.trace_g(gt)) == pytest.approx(np.trace(mean_outer(rg)), rel=1e-4)
        assert float(block.positions([record])) == p


WRONG = ["scale_omitted", "scale_squared", "a_b_swapped"]


@pytest.mark.parametrize("variant", WRONG)
def test_wrong_scale_or_product_order_is_caught(variant):
    """Each wrong derivation gives rows that miss the per-example gradients and factors that
    differ from THOR's: the references above would fail if the block made these mistakes."""
    case = "dense"
    model, layer, x, x64, y, g, params = _setup(case)
    n = len(x)
    mat_a, mat_b = _grad_matrices(case, x64, y, params)
    a_a, g_a, a_b, g_b = _rows(case, x64, g, params, variant)
    a_b = homogeneous(a_b, True)
    assert not np.allclose(_example_sums(a_a, g_a, n), mat_a, rtol=1e-3, atol=1e-6)
    assert not np.allclose(_example_sums(a_b, g_b, n), mat_b, rtol=1e-3, atol=1e-6)
    # Factors only: the rule in use (the default) does not matter here.
    wrapped = thor_tf.wrap(model, learning_rate=1.0, damping=0.1, verbose=False)
    wrapped.compile(loss="mse", run_eagerly=True)
    wrapped.train_on_batch(x, y.astype("float32"))
    got_a, got_b = wrapped.thor.factors("blk/lora_a"), wrapped.thor.factors("blk/lora_b")
    assert not np.allclose(got_a["G"], mean_outer(g_a), rtol=1e-2)
    assert not np.allclose(got_b["A"], mean_outer(a_b), rtol=1e-2)


# -- discovery, training, checkpoints -----------------------------------------------------------
def _tiny_lm(v=11, t=6, d=8, seed=5):
    """Embedding → MultiHeadAttention → Dense → Dense head, LoRA on the attention projections and
    the feed-forward Dense (kernels frozen), as ``backbone.enable_lora`` does."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((t,), dtype="int32")
    h = keras.layers.Embedding(v, d, name="tokens")(inputs)
    h = h + keras.layers.MultiHeadAttention(2, 4, name="mha")(h, h, use_causal_mask=True)
    h = keras.layers.Dense(d, activation="relu", name="ff")(h)
    model = keras.Model(inputs, keras.layers.Dense(v, name="head")(h))
    for layer in model._flatten_layers(include_self=False):
        layer.trainable = False
    for layer in model._flatten_layers(include_self=False):
        if layer.name in ("query", "value", "ff"):
            layer.trainable = True
            layer.enable_lora(2)
    return model


def _lm_data(v=11, t=6, n=16, seed=6):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, v, size=(n, t + 1)).astype("int32")
    return tokens[:, :-1], tokens[:, 1:]


def test_lora_model_gets_adapter_blocks_and_trains_with_frozen_kernels():
    model = _tiny_lm()
    x, y = _lm_data()
    before = model.predict(x, verbose=0)
    wrapped = thor_tf.wrap(model, learning_rate=0.05, frequency=2, verbose=False)
    np.testing.assert_array_equal(wrapped.predict(x, verbose=0), before)  # wrap changes nothing
    kinds = {b.name: b.kind for b in wrapped.thor.blocks}
    assert kinds == {"query/lora_a": "lora A", "query/lora_b": "lora B",
                     "value/lora_a": "lora A", "value/lora_b": "lora B",
                     "ff/lora_a": "lora A", "ff/lora_b": "lora B"}
    assert wrapped.thor.first_order == []
    frozen = {v.path: v.numpy() for v in model.non_trainable_variables}
    adapters = {v.path: v.numpy() for v in model.trainable_variables}
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    losses = [float(wrapped.train_on_batch(x, y)) for _ in range(6)]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]
    for v in model.non_trainable_variables:
        np.testing.assert_array_equal(v.numpy(), frozen[v.path])
    # Every B moves from its zero start; then A (whose gradient is s·xᵀ·g·Bᵀ: zero while B is).
    # The query's gradient through the attention logits is ~1e-7 here, its A's steps are below
    # float32's resolution of A: not checked.
    moved = [v.path for v in model.trainable_variables
             if not np.array_equal(v.numpy(), adapters[v.path])]
    for name in ("query/lora_kernel_b", "value/lora_kernel_b", "ff/lora_kernel_b",
                 "value/lora_kernel_a", "ff/lora_kernel_a"):
        assert any(path.endswith(name) for path in moved), (name, moved)
    assert all(s["refreshes"] >= 1 for s in wrapped.thor.layer_stats())


def test_lora_checkpoint_and_save_load_round_trip(tmp_path):
    model = _tiny_lm()
    x, y = _lm_data()
    wrapped = thor_tf.wrap(model, learning_rate=0.05, frequency=2, verbose=False)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    for _ in range(3):
        wrapped.train_on_batch(x, y)

    # tf.train.Checkpoint: adapters and THOR's state come back; training continues identically.
    ckpt = tf.train.Checkpoint(model=model, optimizer=wrapped.optimizer)
    path = ckpt.write(os.path.join(tmp_path, "lora_ckpt"))
    other = _tiny_lm(seed=9)
    other_wrapped = thor_tf.wrap(other, learning_rate=0.05, frequency=2, verbose=False)
    other_wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    other_wrapped.optimizer.build(other.trainable_variables)
    tf.train.Checkpoint(model=other, optimizer=other_wrapped.optimizer).read(path).expect_partial()
    for a, b in zip(wrapped.optimizer.variables, other_wrapped.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    for _ in range(2):  # a reuse step and a cadence step
        wrapped.train_on_batch(x, y)
        other_wrapped.train_on_batch(x, y)
    for a, b in zip(model.get_weights(), other.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)



def _tiny_lora_regressor(seed=11):
    """Dense and EinsumDense with LoRA at the top level of a Functional model (their config
    carries ``lora_rank``, so Keras enables LoRA again on load), a frozen head."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((3, 4))
    ff = keras.layers.Dense(6, activation="relu", name="ff")
    heads = keras.layers.EinsumDense("abc,cde->abde", (3, 2, 3), bias_axes="e", name="heads")
    head = keras.layers.Dense(2, name="head")
    model = keras.Model(inputs, head(keras.layers.Flatten()(heads(ff(inputs)))))
    ff.enable_lora(2)
    heads.enable_lora(2, lora_alpha=4)
    head.trainable = False
    return model


def test_lora_save_load_round_trip(tmp_path):
    """model.save / load_model: Keras merges the adapters into the kernel (W + s·A·B) and loads
    them as zeros (its LoRA layers' own save format); predictions, blocks and THOR's state come
    back. (LoRA on MultiHeadAttention's projections does not survive Keras' load: MHA rebuilds
    them without LoRA; use tf.train.Checkpoint, above, or KerasHub's save_lora_weights.)"""
    model = _tiny_lora_regressor()
    rng = np.random.default_rng(12)
    x, y = rng.normal(size=(16, 3, 4)).astype("float32"), rng.normal(size=(16, 2)).astype("float32")
    wrapped = thor_tf.wrap(model, learning_rate=0.1, frequency=2, verbose=False)
    assert [b.name for b in wrapped.thor.blocks] == ["ff/lora_a", "ff/lora_b", "heads/lora_a",
                                                     "heads/lora_b"]
    wrapped.compile(loss="mse")
    for _ in range(3):
        wrapped.train_on_batch(x, y)
    file = os.path.join(tmp_path, "lora.keras")
    wrapped.save(file)
    loaded = keras.models.load_model(file)
    assert isinstance(loaded, thor_tf.ThorModel)
    np.testing.assert_allclose(loaded.predict(x, verbose=0), wrapped.predict(x, verbose=0),
                               rtol=1e-5, atol=1e-5)
    assert [b.name for b in loaded.thor.blocks] == [b.name for b in wrapped.thor.blocks]
    for a, b in zip(wrapped.optimizer.variables, loaded.optimizer.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


def test_lora_enabled_after_wrap_is_named_first_order_with_the_fix():
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(3, name="ff")
    model = keras.Sequential([keras.Input((4,)), layer])
    wrapped = thor_tf.wrap(model, verbose=False)
    layer.enable_lora(2)
    wrapped.compile(loss="mse")
    assert wrapped.thor.blocks == []
    assert [(l.name, r) for l, r in wrapped.thor.first_order] == [
        ("ff", "LoRA enabled after wrap: wrap the model after enable_lora")]


def test_lora_blocks_on_two_replicas_take_the_single_device_step():
    """MirroredStrategy over 2 logical CPUs against one device (tests/scripts/replicas_vs_one.py,
    model "lora": a Dense and a heads EinsumDense with LoRA, everything else frozen): weights,
    decisions, ν, factors and inverses as on one device, replicas identical."""
    import sys
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from test_distribute import _run_file

    r = _run_file("replicas_vs_one.py", 2, "all", "lora")["lora"]
    assert r["replicas"] == 2 and r["copies"] == 2, r
    # The all-reduced sums round otherwise than one device's (~1e-6 relative); the default
    # rule's step grows that up to 1/ε_r = 100 (Adam in the eigenbasis) and Newton–Schulz's
    # gain on small singular values (up to ~485): 1e-3 of the step (measured 5.3e-5 with oneDNN,
    # 3.7e-5 without; the former 1e-4 was 1.9x away; in test_distribute.py, replicas each on
    # their own factors were 84 % of a step off).
    same_step = 1e-3
    assert r["relative_weight_diff"] < same_step, r
    assert r["decisions_many"] == r["decisions_one"] and len(r["decisions_one"]) == 4, r
    assert all(d[0] >= 1 for d in r["decisions_one"]), r
    assert abs(r["nu_many"] - r["nu_one"]) <= 1e-5 * abs(r["nu_one"]), r
    assert r["factor_inverse_diff"] < same_step, r  # eigenvalues and moments: as sensitive
    assert r["replicas_identical"], r



@pytest.mark.parametrize("case", ["dense", "einsum_heads"])
def test_qlora_int8_adapters_have_their_blocks(case):
    """QLoRA: ``quantize("int8")`` then ``enable_lora``. Keras runs such a layer through
    ``quantized_call`` (the hooks observe it too); the adapters' rows do not involve the kernel,
    so the factors are the float path's formulas on the layer's own output ``z`` (Keras' forward:
    the int8 product is not re-derived here). The int8 kernel and its scale do not move."""
    model, layer, x = _build(case, quantize="int8")
    assert layer.quantization_mode == "int8"
    _, a, b, _ = _params(layer)
    params = (None, a, b, None)
    z = model(x).numpy().astype(np.float64).reshape((len(x),) + tuple(
        layer.compute_output_shape((None,) + x.shape[1:])[1:]))
    n, k = len(x), int(np.prod(z.shape[1:]))
    y = np.random.default_rng(7).normal(size=(n, k))
    g = (2.0 * (z.reshape(n, -1) - y) / k).reshape(z.shape)
    a_a, g_a, a_b, g_b = _rows(case, x.astype(np.float64), g, params)
    a_b = homogeneous(a_b, _b_folded(case))
    frozen = [(v, v.numpy()) for v in layer.non_trainable_variables]
    wrapped = thor_tf.wrap(model, learning_rate=0.1, damping=0.1, verbose=False)
    assert [bl.name for bl in wrapped.thor.blocks] == ["blk/lora_a", "blk/lora_b"]
    wrapped.compile(loss="mse")
    wrapped.train_on_batch(x, y.astype("float32"))
    got_a, got_b = wrapped.thor.factors("blk/lora_a"), wrapped.thor.factors("blk/lora_b")
    np.testing.assert_allclose(got_a["A"], mean_outer(a_a), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_a["G"], mean_outer(g_a), rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(got_b["A"], mean_outer(a_b), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got_b["G"], mean_outer(g_b), rtol=1e-4, atol=1e-9)
    for v, before in frozen:
        np.testing.assert_array_equal(v.numpy(), before)
    assert not np.array_equal(layer.lora_kernel_b.numpy(), b.astype("float32"))


def test_padded_tokens_count_in_neither_adapter_factor():
    """A per-token loss with padding (sample weight 0): the A side's ``A = mean x xᵀ`` and the B
    side's ``A = mean [s·x·A, 1][s·x·A, 1]ᵀ`` are over the valid tokens only (float64, explicit
    rows). Before the engine read the block's ``mask_width`` (z's features per token), the A
    side's G over the rank did not divide z per token, the mask was dropped and the padded rows
    counted."""
    keras.utils.set_random_seed(0)
    layer = keras.layers.Dense(6, name="blk")
    model = keras.Sequential([keras.Input((5, 4)), layer])
    layer.enable_lora(RANK, lora_alpha=ALPHA)
    rng = np.random.default_rng(0)
    layer.lora_kernel_b.assign(rng.normal(size=layer.lora_kernel_b.shape).astype("float32"))
    x = rng.normal(size=(4, 5, 4)).astype("float32")
    y = rng.integers(0, 6, size=(4, 5))
    w = np.ones((4, 5), "float32")
    w[:, 3:] = 0.0  # the last two tokens of every sequence are padding
    a = layer.lora_kernel_a.numpy().astype(np.float64)
    wrapped = thor_tf.wrap(model, preset="thor_nt", frequency=1, verbose=False)
    wrapped.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    wrapped.train_on_batch(x, y, sample_weight=w)
    def factors(rows):
        u = np.concatenate([SCALE * rows @ a, np.ones((len(rows), 1))], axis=1)
        return {"blk/lora_a": rows.T @ rows / len(rows), "blk/lora_b": u.T @ u / len(u)}

    every = x.reshape(-1, 4).astype(np.float64)
    expected, unmasked = factors(every[w.reshape(-1) > 0]), factors(every)
    for name, want in expected.items():
        got = wrapped.thor.factors(name)["A"]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=name)
        assert not np.allclose(got, unmasked[name], rtol=1e-3)
