"""Muon's Newton–Schulz iteration: the approximate orthogonal factor of the eigenbasis rule's step.

The orthogonal (polar) factor of ``X = U Σ Vᵀ`` is ``U Vᵀ``. Muon (Jordan et al. 2024)
approximates it by ``X ← X/(‖X‖_F + ε)`` and then five times ``A = XXᵀ``,
``X ← aX + (bA + cA²)X`` with ``(a, b, c) = NS_COEFFICIENTS``: every iterate is ``p_k(A_0) X_0``
for a polynomial ``p_k``, so each singular value moves alone,
``σ_{k+1} = σ_k (a + bσ_k² + cσ_k⁴)``, and the result is ``U diag(σ_K/σ_0) Uᵀ X_0``.

Two ways to evaluate it, both as accurate as the float32 iteration itself (measured against the
float64 iteration: docs/internals.md, "Newton–Schulz's accuracy"):

* ``"iterate"``: the float32 products, on the small Gram matrix's side (a wide ``X``:
  ``A = XXᵀ``, the polynomial on the left; a tall one: ``A = XᵀX``, on the right, no transposes).
  ``10·s²·l + 5·s³`` multiply-adds for a ``[s, l]`` matrix (short side ``s``).
* ``"spectral"``: the gain ``g(σ²) = σ_K/σ_0`` through the eigendecomposition of the Gram matrix
  ``A_0 = V diag(σ²) Vᵀ``, then ``X_0 V diag(g) Vᵀ``: one ``eigh`` and three products instead of
  fifteen. **In float64.** The gain tends to ``a⁵ ≈ 485`` for small ``σ``, and its slope in
  ``σ²`` there is ``~1.5e7``: the result depends on ``A_0`` far more finely than float32
  resolves it. A float32 Gram matrix's round-off (``~ε·‖A_0‖`` in every direction) moved a
  near-singular block's result by up to 8e-4 of its largest entry, and a float32 ``eigh``'s
  eigenvectors (error ``~ε``, then weighted by gains up to 485) by 1e-4, where the float32
  iteration stays at ~1e-5 (it recomputes each ``A_k`` from ``X_k``, so an early round-off is not
  carried through the degree-243 polynomial). ``X`` converts to float64 exactly; the Gram matrix,
  ``eigh``, ``P = V diag(g) Vᵀ`` and ``X P`` in float64 leave only the final rounding to float32.

``"auto"`` (the default) takes, per tensor, the cheaper of the two on this hardware: on a CPU
:func:`spectral_is_cheaper` (float64 ``eigh`` is as cheap as the products on a single matrix of
short side up to 16, and cheaper on a batch of short side up to 32, where oneDNN's batched
products of small matrices are slow; above that the float32 products win); where TensorFlow
sees a GPU, ``"iterate"`` (its products are fast, its float64 is not).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["NS_COEFFICIENTS", "NS_METHODS", "NS_STEPS", "SPECTRAL_MAX", "SPECTRAL_MAX_BATCHED",
           "newton_schulz", "newton_schulz_many", "spectral_is_cheaper"]

#: Muon's quintic coefficients (a, b, c): ``X ← a X + (b A + c A²) X`` with ``A = X Xᵀ``.
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
#: Iterations (Muon's default).
NS_STEPS = 5
#: :func:`newton_schulz`'s ways of evaluating the iteration.
NS_METHODS = ("auto", "spectral", "iterate")
#: Largest short side that ``"auto"`` evaluates through float64 ``eigh`` for a single matrix,
#: and for a batch of several (the batch's ``eigh`` runs matrix by matrix; the products batch).
#: Measured as wall time of four independent matrices in one ``tf.function`` (2-core AMD EPYC,
#: TF 2.21; float32 products against float64 spectral, ms, oneDNN on, then off): ``[16, 144]``
#: 0.37 / 0.38 and 0.35 / 0.32, ``[32, 288]`` 0.58 / 0.75 and 0.52 / 0.64, ``[64, 289]``
#: 0.82 / 2.14 and 1.36 / 2.54, ``[128, 129]`` 1.38 / 4.66 and 2.83 / 4.73; one batch
#: ``[8, 16, 144]`` 0.74 / 0.35 and 0.49 / 0.37, ``[8, 32, 288]`` 1.57 / 1.42 and 1.79 / 1.36.
#: An earlier host's CPU-time measurement of padded batches put the single matrix's limit at
#: 64; the rule's updates are single matrices since the orthogonal step stopped batching them.
SPECTRAL_MAX = 16
SPECTRAL_MAX_BATCHED = 32


def spectral_is_cheaper(batch: int, short: int) -> bool:
    """Whether float64 ``eigh`` costs less than the float32 products on a CPU for ``batch``
    matrices of short side ``short`` (:data:`SPECTRAL_MAX`, :data:`SPECTRAL_MAX_BATCHED`)."""
    return short <= (SPECTRAL_MAX if batch == 1 else SPECTRAL_MAX_BATCHED)


def newton_schulz(x, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, epsilon=1e-7,
                  method="auto"):
    """Approximate orthogonal factor of each matrix of ``x`` (``[..., r, c]``, float32): Muon's
    Newton–Schulz iteration, ``X ← X / (‖X‖_F + ε)`` then ``steps`` times ``A = X Xᵀ``,
    ``X ← aX + (bA + cA²)X`` (a tall ``X``: the same on ``Xᵀ``). A zero matrix stays zero.

    ``method``: ``"auto"``, ``"spectral"`` or ``"iterate"`` (module docstring). A matrix with a
    non-finite entry gives zeros under ``"spectral"`` (``eigh`` would raise; the rule discards
    such a step, see ``Eigenbasis.update_step``) and NaN under ``"iterate"``."""
    return newton_schulz_many([x], steps, coefficients, epsilon, method)[0]


def newton_schulz_many(xs, steps=NS_STEPS, coefficients=NS_COEFFICIENTS, epsilon=1e-7,
                       method="auto", blend=None):
    """:func:`newton_schulz` of each tensor of ``xs`` (a list of ``[..., r_i, c_i]`` float32), as
    a list. The spectral ones share one evaluation of the gain's scalar recursion (on their
    eigenvalues concatenated: its ~30 elementwise ops once, not per tensor; the eigenbasis rule
    passes each block's update as a tensor of its own).

    ``blend``: None, or ``(k, w)`` with ``k`` an int >= 1 and ``w`` a float32 scalar tensor in
    [0, 1]: each result is ``w·X_steps + (1 − w)·X_k``, two iterates of the same iteration (the
    one with fewer iterations is the other's intermediate, so the blend costs an add, not a
    second iteration). Every iterate is ``p(A_0)X_0``, so the blend too moves each singular
    value alone: ``σ ↦ w·σ_steps + (1 − w)·σ_k``."""
    if method not in NS_METHODS:
        raise ValueError(f"`method` must be one of {NS_METHODS}; got {method!r}.")
    if blend is not None:
        k, weight = blend
        if isinstance(k, bool) or not isinstance(k, int) or k < 1 or int(steps) < 1:
            raise ValueError(f"`blend`'s count must be an int >= 1 and `steps` >= 1; got "
                             f"{k!r} and {steps!r}.")
        counts = (int(steps), k)
        weight = tf.cast(weight, tf.float32)
    else:
        counts, weight = (int(steps),), None
    on_gpu = method == "auto" and bool(tf.config.list_logical_devices("GPU"))
    out, spectral, tall = [None] * len(xs), [], []
    for n, x in enumerate(xs):
        x = tf.convert_to_tensor(x, tf.float32)
        tall.append(x.shape[-2] > x.shape[-1])
        short = min(int(x.shape[-2]), int(x.shape[-1]))
        batch = int(np.prod(x.shape[:-2]))
        norm = tf.sqrt(tf.reduce_sum(tf.square(x), axis=[-2, -1], keepdims=True))
        x = x / (norm + epsilon)
        use = method if method != "auto" else (
            "iterate" if on_gpu or not spectral_is_cheaper(batch, short) else "spectral")
        if int(steps) <= 0:
            pass
        elif use == "spectral":
            spectral.append(n)
        else:
            x = _iterate(x, counts, coefficients, tall[n], weight)
        out[n] = x
    if spectral:
        results = _spectral_iterations([out[n] for n in spectral], counts, coefficients,
                                       [tall[n] for n in spectral], weight)
        for n, x in zip(spectral, results):
            out[n] = x
    return out


def _gram(x, tall):
    """``XᵀX`` (``[..., c, c]``) of a tall ``x``, ``XXᵀ`` (``[..., r, r]``) of a wide one."""
    return tf.matmul(x, x, transpose_a=True) if tall else tf.matmul(x, x, transpose_b=True)


def _iterate(x, counts, coefficients, tall, weight=None):
    """The iteration's float32 products on a normalized ``x``: wide ``X ← aX + (bA + cA²)X``
    with ``A = XXᵀ``; tall ``X ← aX + X(bA + cA²)`` with ``A = XᵀX`` (the transpose of the wide
    iteration on ``Xᵀ``, through the products' transpose flags). ``counts``: ``(K,)``, the
    result ``X_K``; or ``(K, k)``, the result ``weight·X_K + (1 − weight)·X_k``."""
    a, b, c = (tf.constant(value, tf.float32) for value in coefficients)
    iterates = {}
    for n in range(1, max(counts) + 1):
        gram = _gram(x, tall)
        poly = b * gram + c * tf.matmul(gram, gram)
        x = a * x + (tf.matmul(x, poly) if tall else tf.matmul(poly, x))
        if n in counts:
            iterates[n] = x
    if len(counts) == 1:
        return iterates[counts[0]]
    return weight * iterates[counts[0]] + (1.0 - weight) * iterates[counts[1]]


def _spectral_iterations(xs, counts, coefficients, talls, weight=None):
    """The iteration on each normalized ``x`` of ``xs`` (``[..., r, c]``, float32) through the
    eigenvalues of its small Gram matrix, in float64: wide ``A_0 = x xᵀ = V diag(σ²) Vᵀ`` and the
    result ``V diag(g(σ²)) Vᵀ x``; tall (``talls``) ``A_0 = xᵀx`` and ``x V diag(g) Vᵀ``.
    ``g = Π_k (a + bσ_k² + cσ_k⁴)`` with ``σ_{k+1}² = σ_k²(a + bσ_k² + cσ_k⁴)²``, evaluated once on
    all the tensors' eigenvalues; ``counts`` as :func:`_iterate`'s (a blend of two iterates is
    the blend of their gains). A single row or column (short side 1) needs no ``eigh``: its
    Gram matrix is its squared norm. A matrix with a non-finite entry is taken as zero."""
    a, b, c = (tf.constant(value, tf.float64) for value in coefficients)
    bases, sizes, s2s = [], [], []
    for x, tall in zip(xs, talls):
        finite = tf.reduce_all(tf.math.is_finite(x), axis=[-2, -1], keepdims=True)
        x = tf.cast(tf.where(finite, x, tf.zeros_like(x)), tf.float64)  # exact
        if int(x.shape[-1 if tall else -2]) == 1:
            w, v = tf.reduce_sum(tf.square(x), axis=-2 if tall else -1), None
        else:
            w, v = tf.linalg.eigh(_gram(x, tall))  # ascending σ², V
        bases.append((x, v, tall))
        sizes.append(int(np.prod(w.shape)))
        s2s.append(tf.reshape(w, [-1]))
    # Round-off can make a null direction's σ² slightly negative.
    s2 = tf.maximum(s2s[0] if len(s2s) == 1 else tf.concat(s2s, 0), 0.0)
    gain, gains_at = None, {}
    for k in range(max(counts)):
        f = a + s2 * (b + c * s2)
        gain = f if gain is None else gain * f
        if k + 1 in counts:
            gains_at[k + 1] = gain
        if k + 1 < max(counts):
            s2 = s2 * tf.square(f)
    if len(counts) == 1:
        gain = gains_at[counts[0]]
    else:
        w = tf.cast(weight, tf.float64)
        gain = w * gains_at[counts[0]] + (1.0 - w) * gains_at[counts[1]]
    gains = [gain] if len(xs) == 1 else tf.split(gain, sizes)
    out = []
    for (x, v, tall), g in zip(bases, gains):
        g = tf.reshape(g, x.shape[:-2] + [int(x.shape[-1] if tall else x.shape[-2])])
        if v is None:
            y = x * tf.expand_dims(g, -2 if tall else -1)
        else:
            # P = V diag(g) Vᵀ on the short side first ([..., s, s]: s³), then one product with
            # x (s²·l): the long side enters two products, the Gram matrix and this one.
            p = tf.matmul(v * tf.expand_dims(g, -2), v, transpose_b=True)
            y = tf.matmul(x, p) if tall else tf.matmul(p, x)
        out.append(tf.cast(y, tf.float32))
    return out
