"""``Eigenbasis``: Adam in the eigenbasis of each block's split factors (EKFAC, George et al.
2018; SOAP, Vyas et al. 2024), with THOR's trace rule deciding when a block's basis is renewed.

Per block with gradient matrix ``M`` (``[a_dim, g_dim]``, bias row folded in; see
:mod:`thor_tf.blocks.base`) and split factors ``A = ⊕_i A_i``, ``G = ⊕_j G_j``:

* at a refresh (the trace rule, or ``max_block_age``): ``A_i = Q_A,i Λ_A,i Q_A,iᵀ`` and
  ``G_j = Q_G,j Λ_G,j Q_G,jᵀ`` for every diagonal block (:mod:`thor_tf.rules.eigenbasis_refresh`:
  batched per size bucket, float64, a tie-breaking diagonal ramp; ``refresh="power_qr"``: one
  float32 power step and QR from the basis in use instead, skipped where the factor is still
  nearly diagonal in it, float64 ``eigh`` where a check fails); the moments are carried into
  the new bases with ``R = Q_oldᵀ Q_new`` per block: ``m ← R_Aᵀ m R_G`` (exact),
  ``v ← (R_A∘R_A)ᵀ v (R_G∘R_G)`` (the diagonal of ``Rᵀ diag(v) R`` on each side). Keeping ``v`` as it was across a basis change diverged on the
  digits CNN (DESIGN.md §9).
* every step: ``M' = Q_Aᵀ M Q_G``; ``m ← β1 m + (1−β1) M'``, ``v ← β2 v + (1−β2) M'²``;
  ``Δ' = m̂ / (√v̂ + ε + ε_r·√mean(v̂))`` (bias-corrected with the optimizer's step ``t``; the
  mean over the block); ``Δ = Q_A Δ' Q_Gᵀ``. ``beta_2_growth=c``: ``β2_t = min(β2, 1 − t^−c)``
  (Adafactor's schedule, capped), ``v̂ = v`` (``β2_1 = 0``: the average's weights sum to one from
  the first step): a short memory early, Adam's long one late, where the gradients shrink.
  ``beta_1_end=e``: β1 follows the rate, ``β1_t = e + (β1 − e)·η_t/η_max`` with ``η_max`` the
  largest rate so far (a model-wide optimizer variable): ``β1`` at the peak, ``e`` as the rate
  goes to 0 (``e > β1``: Smith's one-cycle momentum, a longer memory as the rate anneals;
  ``e < β1``: a shorter one), capped at ``1 − 1/t`` (``β1_1 = 0``) and ``m̂ = m``
  (docs/levers.md, ``beta1_rate`` and ``beta1_cool``). ``relative_epsilon_end=e``: ``ε_r`` follows
  the rate the same way, ``ε_r,t = e + (ε_r − e)·η_t/η_max`` (``e > ε_r``: a damping that grows
  as the cosine anneals). ``step_norm_epsilon=k``: each block's ``Δ'`` is scaled to the
  Frobenius norm of the step with ``ε_r = k`` (``‖Δ'_k‖/‖Δ'‖``), so ``ε_r`` chooses the
  direction only and not the size (a larger ``ε_r`` alone shrinks the step: at 0.5 to ~0.65×
  0.1's on the Fashion CNN).
* ``step="orthogonal"`` (the default; SOAP-Muon): ``Δ ← NS(Δ)·‖Δ‖_F/‖NS(Δ)‖_F``, the Newton–Schulz
  orthogonal factor of the whole ``[a_dim, g_dim]`` step (:mod:`thor_tf.rules.orthogonal_step`,
  each block's update a 2-D matrix of its own, the products or ``eigh`` of its Gram matrix) at the
  Adam step's Frobenius norm (``scale="graft"``; ``"rms"``: Muon's ``0.2·√max(a_dim, g_dim)``
  instead). Adam's division in the eigenbasis chooses the direction's weighting, the
  orthogonalization equalizes its singular values, the graft keeps Adam's step size, so the rate
  stays on Adam's scale. ``step="adam"``: Δ as it is (the default
  before; ``update_rule="eigenbasis_adam"``).
* ``neuron_norm`` (NorMuon, Li et al. 2025; off by default): after the orthogonal step, each
  neuron's share of it (``"output"``: the ``g_dim`` output units, the paper's; ``"long"``: the
  longer side's, which the orthogonal factor of a non-square step leaves unequal, as
  modded-nanogpt's NorMuon takes it) is divided by the root of a running mean of its
  squares, ``n ← β2 n + (1−β2)·mean_neuron(O₁²)`` with ``O₁ = O/RMS(O)`` (the step at unit
  RMS, so ``n`` does not follow the step's size) and ``O ← O₁/(√n + ε)``, then scaled back to
  the step's Frobenius norm (its ``scale``).
* the optimizer: ``w ← w − lr·(Δ + wd·w)`` (decoupled weight decay, ``weight_decay_exclude``
  chooses the variables); every variable without a block (or a block without a record in a step)
  takes AdamW with the same β1, β2, ε.

By default (:attr:`Eigenbasis.default_split`) factors are split at 128 and those wider than 512
keep their diagonal: that side of the layer is not rotated (Adam's coordinates there).

With ``Q = I`` and ``step="adam"`` the step is Adam's. Either step does not depend on the loss's
scale (a loss ×1000 gives the same steps up to ε) nor on an orthogonal change of the input
features, and needs no damping (eigenvectors do not move with it). ``clip_norm`` clips each
gradient tensor by its norm before the moments (Keras' ``clipnorm``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf
from keras import ops

from thor_tf import _keras_compat, block_matrices
from thor_tf.split.information import kept_curve
from thor_tf.rules.adam_step import adam_moments, stacked_adam_directions
from thor_tf.rules.base import (SideWork, SplitCost, UpdateRule, keras_serializable, side_matrix,
                                split_blocks)
from thor_tf.rules.eigenbasis_ops import (REFRESHES, TIE_BREAK, eigh_blocks, refresh_selected,
                                          rotate_in, rotate_out)
from thor_tf.rules.eigenbasis_refresh import refresh_bases
from thor_tf.rules.newton_schulz import NS_STEPS
from thor_tf.rules.orthogonal_step import orthogonalized
from thor_tf.rules.inverse import identity_blocks
from thor_tf.split.plan import SplitPlan


@dataclasses.dataclass
class EigenLayerState:
    """One block's factors, bases, eigenvalues and moments (optimizer variables).

    ``A``/``G`` and ``Q_A``/``Q_G``: ``[nb, d, d]`` (bases' columns are eigenvectors, identity
    before the first refresh and on padding); ``w_A``/``w_G``: ``[nb, d]`` eigenvalues (0 on
    padding); ``m``/``v``: ``[a_dim, g_dim]`` Adam's moments in the current bases;
    ``neuron_v``: :attr:`Eigenbasis.neuron_norm`'s moment (in the layer's own coordinates, so a
    refresh leaves it as it is) or None.
    """

    A: object
    G: object
    Q_A: object
    Q_G: object
    w_A: object
    w_G: object
    m: object
    v: object
    #: ``neuron_norm``: the second moment per neuron of the orthogonal step (``[k]``, k the
    #: normalized side's length), else None.
    neuron_v: object = None

    def shapes(self):
        """``(A's shape, G's shape)`` as tuples."""
        return tuple(tuple(int(d) for d in v.shape) for v in (self.A, self.G))


@keras_serializable
class Eigenbasis(UpdateRule):
    """Adam in the eigenbasis of THOR's split factors (module docstring).

    Args:
      beta_1: first-moment decay, in [0, 1).
      beta_2: second-moment decay, in [0, 1) (0.95: SOAP's and the measured default); with
        ``beta_2_growth`` the value it grows to.
      beta_2_growth: None (a constant ``beta_2``, bias-corrected as Adam's) or ``c`` in (0, 1]:
        at step ``t`` (from 1) the decay is ``min(beta_2, 1 − t^−c)`` (Adafactor's 0.8 grows it
        to 0.99 at t ≈ 316, 0.999 at t ≈ 5,600) and no bias correction is needed (``β2_1 = 0``).
        Late in a long run the gradients vanish; a short memory then keeps the step's size as
        if they had not (docs/anatomy.md), a growing one lets it shrink as Adam's does. The
        same decay for the variables without a block. Steps skipped as non-finite still count
        in ``t``.
      beta_1_end: None (a constant ``beta_1``, bias-corrected as Adam's) or ``e`` in [0, 1):
        β1 moves with the rate, linearly from ``beta_1`` at the largest rate so far ``η_max`` to
        ``e`` at a rate of 0, ``β1_t = e + (beta_1 − e)·η_t/η_max`` (one-cycle momentum when
        ``e > beta_1``), and ``min(β1_t, 1 − 1/t)`` so that no bias correction is needed
        (``β1_1 = 0``). The same decay for the variables without a block. Under a constant
        rate it is ``beta_1`` throughout.
      relative_epsilon_end: None (a constant ``relative_epsilon``) or ``e`` >= 0: the relative ε
        moves with the rate as ``beta_1_end`` moves β1, ``ε_r,t = e + (ε_r − e)·η_t/η_max``:
        ``relative_epsilon`` at the largest rate so far, ``e`` at a rate of 0 (``e`` above it:
        the eigendirections the gradients barely reach are damped more as the cosine anneals,
        docs/levers.md ``releps_rise``). Blocks only (the variables without a block take Adam's
        ``epsilon``).
      step_norm_epsilon: None (the step's own norm) or ``k`` >= 0: each block's step in the
        eigenbasis is scaled to the Frobenius norm it has with ``relative_epsilon=k`` (the
        graft then takes that norm): ``relative_epsilon`` (and ``relative_epsilon_end``) choose
        the direction alone.
      epsilon: added to ``√v̂``, > 0.
      relative_epsilon: also added to ``√v̂``, times the block's RMS ``√mean(v̂)`` (>= 0): a
        rotated direction whose gradient is far below the block's RMS is round-off, not a
        direction to take a full step in; a larger one also damps the directions the gradients
        barely reach (K-FAC's damping in the eigenbasis). None: 1e-4 for ``step="adam"``, 0.1
        for ``"orthogonal"`` (:attr:`DEFAULT_RELATIVE_EPSILON`).
      tie_break: a ramp ``tie_break·(tr/d)·k/d`` on the diagonal of each d-block before ``eigh``
        (>= 0; :func:`thor_tf.rules.eigenbasis_ops._padded_for_eigh`): fixes the basis of a degenerate eigenspace
        (A's null space under a small batch) to the coordinate axes, the same on every replica
        count and device. 0: exactly rotation-equivariant, and that basis is round-off's choice.
      step: ``"orthogonal"`` (the step's Newton–Schulz orthogonal factor, module docstring) or
        ``"adam"`` (Adam's step in the eigenbasis as it is).
      scale: the orthogonal step's size: ``"graft"`` (the Adam step's Frobenius norm) or
        ``"rms"`` (``rms·√max(a_dim, g_dim)`` times the factor: RMS ≈ ``rms``, Muon's rule).
      rms: the RMS of ``scale="rms"`` (> 0; Muon's 0.2).
      adam_kinds: block kinds (``"conv2d"``, ``"embedding"``, ...) that keep the Adam step under
        ``step="orthogonal"`` (none by default; measured in docs/suite.md).
      refresh: how a refresh renews a block's basis: ``"power_qr"`` (the default: one float32
        power step and QR from the basis in use, skipped where the factor is still nearly
        diagonal in it, a float64 ``eigh`` where a check fails;
        :mod:`thor_tf.rules.eigenbasis_ops`; measured in docs/update_rules.md) or ``"eigh"`` (a
        float64 eigendecomposition at every refresh, the default before). Configs saved
        without it load as ``"eigh"``.
      refresh_tolerance: ``"power_qr"``: the largest off-diagonal residual
        ``‖QᵀFQ − diag‖_F/‖F‖_F`` a power step is accepted with (>= 0), else ``eigh``. 0.5: a
        guard against a failed step; on the suite's workloads the residuals after a step were
        0.07–0.13 (median), at most 0.34 (90 %), and 0.1 sent 14–55 % of the blocks to ``eigh``
        as well, which costs more than ``eigh`` alone (docs/update_rules.md).
      drift_tolerance: ``"power_qr"``: a block whose factor has less off-diagonal mass than this
        in the basis in use keeps it (>= 0; 0: never skip).
      neuron_norm: None, ``"output"`` or ``"long"``: under ``step="orthogonal"``, NorMuon's
        per-neuron normalization of the orthogonal step (module docstring) over its output
        units (the rows of a PyTorch ``[out, in]`` weight, the paper's) or its longer side's
        (modded-nanogpt's; rows of a tall ``[a_dim, g_dim]`` step, columns of a wide one: the
        orthogonal factor's short side already has near-unit vectors). The decay is
        ``beta_2``'s constant, ε is ``epsilon``; blocks of ``adam_kinds`` keep their step as
        it is. Each block is normalized on its own (~10 elementwise ops and reductions; the
        step time within ±4 % of the default's on the char GPT and ResNet-20).
      newton_schulz_steps: under ``step="orthogonal"``, the Newton–Schulz iterations of the
        orthogonal step (int >= 1; Muon's 5). Each multiplies a singular value ``σ`` of the
        Frobenius-normalized step by ``a + bσ² + cσ⁴`` (``a`` = 3.4445): after 5 every ``σ``
        above 0.15 % of the norm sits in [0.68, 1.2] and smaller ones have grown by up to
        ``a⁵ ≈ 485``; after 4 those above 0.5 % (smaller: up to 141×); after 3 those above 1.8 %
        (smaller: up to ``a³ ≈ 41``): the directions the step barely holds are raised less (a
        softer orthogonalization, at 3/5 of the products; docs/levers.md ``ns_steps_3``).
      newton_schulz_steps_end: None (``newton_schulz_steps`` throughout) or ``k`` (int >= 1):
        the iteration count follows the rate as ``beta_1_end`` moves β1, the orthogonal factor
        ``w·O_K + (1 − w)·O_k`` with ``w = η_t/η_max`` and ``K = newton_schulz_steps``: ``K``
        iterations at the largest rate so far, ``k`` at a rate of 0 (``k < K``: a softer
        orthogonalization as the cosine anneals; ``k > K``: a softer one while the rate is high;
        docs/levers.md ``ns_rate_3``, ``ns_early_3``). Both are iterates of one iteration, so it
        costs ``max(K, k)`` iterations.
      refresh_min_size: ``"power_qr"``: blocks (their size bucket) smaller than this take
        ``"eigh"`` (int >= 0; on a CPU the power step is no cheaper below ~100, measured in
        docs/update_rules.md).
    """

    name = "eigenbasis"
    #: The peak rate per ``step`` (the suite's best; docs/suite.md).
    DEFAULT_LEARNING_RATES = {"adam": 0.01, "orthogonal": 0.03}
    #: The run length each peak holds up to (``reference_steps``; None: every length). The
    #: orthogonalized step's 3e-2 won the suite's runs of 186–220 steps; its step has a fixed
    #: size in every direction, so the noise it carries does not shrink as the gradient does and
    #: the wander it adds over T steps grows like peak·sqrt(T): a longer run keeps that wander
    #: with peak·sqrt(256/T) (the Fashion-MNIST main job's 1,407 steps: 1.28e-2; docs/suite.md).
    DEFAULT_REFERENCE_STEPS = {"adam": None, "orthogonal": 256}
    #: ``relative_epsilon`` per ``step`` when not given. Newton–Schulz multiplies a singular value
    #: far below the step's norm by ~3.4⁵ ≈ 490, so a direction whose Adam step is round-off (a
    #: softmax's all-ones logit direction: ~1e-3 of the RMS step under a 1e-4 floor) would get a
    #: large step, different per device and replica count: measured, 2 replicas against one
    #: device on the same batches, 9 % of the step apart (1e-4) against 2e-5 (1e-2). Above that
    #: floor it is a damping: at 0.1 (1e-2 before 2026-11-30) a direction whose gradient RMS is under a
    #: tenth of the block's takes a damped step, not a whitened one, which slows fitting single
    #: examples of repeated data. Measured (docs/levers.md, `releps_big`, paired seeds): held-out
    #: classification gains (the digits CNN +0.78 points over 10 seeds, past tuned Adam; topics
    #: +0.49; the Fashion CNN and ViT at 4x +0.3/+0.4), one-pass LM level, pure fitting loses
    #: (the tabular MLP's training MSE +13 %, the lookup task -5 points, still ahead of their
    #: baselines), 16x runs level.
    DEFAULT_RELATIVE_EPSILON = {"adam": 1e-4, "orthogonal": 1e-1}

    #: Factors wider than 512 keep their diagonal (that side of the layer is not rotated: Adam's
    #: coordinates), the others are split at 128. Measured with the suite's harness
    #: (docs/split_dim.md): the Fashion CNN's 3,137-wide Dense input unrotated, 3 seeds, finals
    #: 89.10 % against 88.95 % (median) at the same steps to the target, ~6 ms of its ~43 ms step
    #: saved; the autoencoder's 784–1,001-wide sides unrotated reach its target in fewer steps;
    #: ResNet-20's 576-wide convolutions within the seeds' spread. Unrotated at 289 the Fashion
    #: CNN lost 0.45 points: the threshold sits above the widest factor where rotating paid.
    default_split = SplitPlan(128, diagonal_above=512)

    #: Options of other rules this one has no use for, and why (the error ``wrap`` raises when
    #: one is set: :func:`thor_tf.rules.with_options`).
    ignored_options = {
        "momentum": "its step keeps Adam's moments in the eigenbasis (set beta_1 / beta_2 on "
                    "thor_tf.rules.Eigenbasis instead)",
        "kl_clip": "its step has no KL trust region (Adam's normalization and Newton-Schulz "
                   "bound it)",
        "damping_split": "it inverts no damped factor",
        "inverse_assignment": "it inverts no factor (every replica renews the bases)",
    }

    STEPS = ("adam", "orthogonal")
    SCALES = ("graft", "rms")
    NEURON_NORMS = (None, "output", "long")
    REFRESHES = REFRESHES
    #: What a saved config without ``refresh`` meant (every release before it existed).
    SAVED_REFRESH = "eigh"

    def __init__(self, beta_1=0.9, beta_2=0.95, epsilon=1e-8, relative_epsilon=None,
                 tie_break=TIE_BREAK, step="orthogonal", scale="graft", rms=0.2, adam_kinds=(),
                 refresh="power_qr", refresh_tolerance=0.5, drift_tolerance=0.01,
                 refresh_min_size=96, beta_2_growth=None, beta_1_end=None, neuron_norm=None,
                 relative_epsilon_end=None, step_norm_epsilon=None,
                 newton_schulz_steps=NS_STEPS, newton_schulz_steps_end=None):
        if beta_2_growth is not None and (
                isinstance(beta_2_growth, bool) or not isinstance(beta_2_growth, (int, float))
                or not 0 < beta_2_growth <= 1):
            raise ValueError("`beta_2_growth` must be None or a float in (0, 1]; got "
                             f"{beta_2_growth!r}.")
        self.beta_2_growth = None if beta_2_growth is None else float(beta_2_growth)
        if refresh not in self.REFRESHES:
            raise ValueError(f"`refresh` must be one of {self.REFRESHES}; got {refresh!r}.")
        for name, value in (("refresh_tolerance", refresh_tolerance),
                            ("drift_tolerance", drift_tolerance)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"`{name}` must be a float >= 0; got {value!r}.")
        if (isinstance(refresh_min_size, bool) or not isinstance(refresh_min_size, int)
                or refresh_min_size < 0):
            raise ValueError(f"`refresh_min_size` must be an int >= 0; got {refresh_min_size!r}.")
        self.refresh_method, self.refresh_min_size = refresh, int(refresh_min_size)
        self.refresh_tolerance = float(refresh_tolerance)
        self.drift_tolerance = float(drift_tolerance)
        if step not in self.STEPS:
            raise ValueError(f"`step` must be one of {self.STEPS}; got {step!r}.")
        if relative_epsilon is None:
            relative_epsilon = self.DEFAULT_RELATIVE_EPSILON[step]
        for name, value in (("beta_1", beta_1), ("beta_2", beta_2)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"`{name}` must be a float in [0, 1); got {value!r}.")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"`epsilon` must be a float > 0; got {epsilon!r}.")
        if (isinstance(relative_epsilon, bool) or not isinstance(relative_epsilon, (int, float))
                or not relative_epsilon >= 0):
            raise ValueError(f"`relative_epsilon` must be a float >= 0; got {relative_epsilon!r}.")
        self.beta_1, self.beta_2, self.epsilon = float(beta_1), float(beta_2), float(epsilon)
        if beta_1_end is not None and (
                isinstance(beta_1_end, bool) or not isinstance(beta_1_end, (int, float))
                or not 0 <= beta_1_end < 1):
            raise ValueError(f"`beta_1_end` must be None or a float in [0, 1); got "
                             f"{beta_1_end!r}.")
        self.beta_1_end = None if beta_1_end is None else float(beta_1_end)
        self.relative_epsilon_end = _none_or_nonnegative("relative_epsilon_end",
                                                         relative_epsilon_end)
        self.step_norm_epsilon = _none_or_nonnegative("step_norm_epsilon", step_norm_epsilon)
        if isinstance(tie_break, bool) or not isinstance(tie_break, (int, float)) or not tie_break >= 0:
            raise ValueError(f"`tie_break` must be a float >= 0; got {tie_break!r}.")
        self.relative_epsilon, self.tie_break = float(relative_epsilon), float(tie_break)
        if scale not in self.SCALES:
            raise ValueError(f"`scale` must be one of {self.SCALES}; got {scale!r}.")
        if isinstance(rms, bool) or not isinstance(rms, (int, float)) or not rms > 0:
            raise ValueError(f"`rms` must be a float > 0; got {rms!r}.")
        self.step, self.scale, self.rms = step, scale, float(rms)
        self.adam_kinds = tuple(sorted(adam_kinds))
        if neuron_norm not in self.NEURON_NORMS:
            raise ValueError(f"`neuron_norm` must be one of {self.NEURON_NORMS}; got "
                             f"{neuron_norm!r}.")
        if neuron_norm is not None and step != "orthogonal":
            raise ValueError("`neuron_norm` normalizes the orthogonal step: it needs "
                             f"step='orthogonal'; got step={step!r}.")
        self.neuron_norm = neuron_norm
        if (isinstance(newton_schulz_steps, bool) or not isinstance(newton_schulz_steps, int)
                or newton_schulz_steps < 1):
            raise ValueError("`newton_schulz_steps` must be an int >= 1; got "
                             f"{newton_schulz_steps!r}.")
        if newton_schulz_steps != NS_STEPS and step != "orthogonal":
            raise ValueError("`newton_schulz_steps` counts the orthogonal step's iterations: it "
                             f"needs step='orthogonal'; got step={step!r}.")
        self.newton_schulz_steps = int(newton_schulz_steps)
        if newton_schulz_steps_end is not None and (
                isinstance(newton_schulz_steps_end, bool)
                or not isinstance(newton_schulz_steps_end, int) or newton_schulz_steps_end < 1):
            raise ValueError("`newton_schulz_steps_end` must be None or an int >= 1; got "
                             f"{newton_schulz_steps_end!r}.")
        if newton_schulz_steps_end is not None and step != "orthogonal":
            raise ValueError("`newton_schulz_steps_end` counts the orthogonal step's iterations: "
                             f"it needs step='orthogonal'; got step={step!r}.")
        self.newton_schulz_steps_end = (None if newton_schulz_steps_end is None
                                        else int(newton_schulz_steps_end))

    @property
    def default_learning_rate(self):
        return self.DEFAULT_LEARNING_RATES[self.step]

    @property
    def reference_steps(self):
        return self.DEFAULT_REFERENCE_STEPS[self.step]

    def get_config(self):
        return {"beta_1": self.beta_1, "beta_2": self.beta_2, "epsilon": self.epsilon,
                "relative_epsilon": self.relative_epsilon, "tie_break": self.tie_break,
                "step": self.step, "scale": self.scale, "rms": self.rms,
                "adam_kinds": list(self.adam_kinds), "refresh": self.refresh_method,
                "refresh_tolerance": self.refresh_tolerance,
                "drift_tolerance": self.drift_tolerance,
                "refresh_min_size": self.refresh_min_size, "beta_2_growth": self.beta_2_growth,
                "beta_1_end": self.beta_1_end, "neuron_norm": self.neuron_norm,
                "relative_epsilon_end": self.relative_epsilon_end,
                "step_norm_epsilon": self.step_norm_epsilon,
                "newton_schulz_steps": self.newton_schulz_steps,
                "newton_schulz_steps_end": self.newton_schulz_steps_end}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config.setdefault("refresh", cls.SAVED_REFRESH)
        return cls(**config)

    # -- state -------------------------------------------------------------------------------------
    def create_layer_state(self, optimizer, block, prefix, layout_a, layout_g):
        made = {}
        for factor, (nb, size) in zip(("A", "G"), (layout_a, layout_g)):
            made[factor] = optimizer.add_variable((nb, size, size), dtype="float32",
                                                  name=f"{prefix}_{factor}")
            made["Q_" + factor] = optimizer.add_variable(
                (nb, size, size), initializer=identity_blocks(nb, size), dtype="float32",
                name=f"{prefix}_{factor}_basis")
            made["w_" + factor] = optimizer.add_variable(
                (nb, size), initializer="zeros", dtype="float32", name=f"{prefix}_{factor}_eigenvalues")
        for moment in ("m", "v"):
            made[moment] = optimizer.add_variable(
                (block.a_dim, block.g_dim), initializer="zeros", dtype="float32",
                name=f"{prefix}_eigen_{moment}")
        if self.neuron_norm is not None and block.kind not in self.adam_kinds:
            made["neuron_v"] = optimizer.add_variable(
                (self._neuron_length(block.a_dim, block.g_dim),), initializer="zeros",
                dtype="float32", name=f"{prefix}_neuron_v")
        return EigenLayerState(**made)

    @property
    def follows_rate(self):
        """Whether β1, ε_r or the iteration count moves with the rate (``beta_1_end``,
        ``relative_epsilon_end``, ``newton_schulz_steps_end``)."""
        return (self.beta_1_end is not None or self.relative_epsilon_end is not None
                or self.newton_schulz_steps_end is not None)

    def create_model_state(self, optimizer):
        """Under an option that follows the rate (:attr:`follows_rate`): the largest rate so
        far, ``η_max`` (a float32 scalar optimizer variable, saved with it); else None."""
        if not self.follows_rate:
            return None
        return optimizer.add_variable((), initializer="zeros", dtype="float32",
                                      name="eigenbasis_largest_rate")

    def build_slots(self, optimizer, var_list):
        """Adam's moments of every variable (those with a block use them only when a step
        finds no record of their layer)."""
        return {name: [optimizer.add_variable_from_reference(v, name=name) for v in var_list]
                for name in ("adam_m", "adam_v")}

    # -- refresh -----------------------------------------------------------------------------------
    def refresh(self, step, layers, refresh, factors, damping):
        """New bases for the refreshing layers, their moments carried into them where a basis
        changed (:func:`thor_tf.rules.eigenbasis_refresh.refresh_bases`)."""
        del damping  # eigenvectors do not move with it
        refresh_bases(self, step, layers, refresh, factors)

    # -- precondition ------------------------------------------------------------------------------
    def precondition(self, step, active, rows_per_term, grads, variables, use_grads):
        ok, clip_norm = step.ok, step.clip_norm
        use_grads = dict(use_grads or {})
        if clip_norm is not None:
            grads = [None if g is None else _clip(g, clip_norm) for g in grads]
            use_grads = {k: _clip(g, clip_norm) for k, g in use_grads.items()}
        t = tf.cast(step.iterations + 1, tf.float32)
        rate = None
        if self.follows_rate:
            rate, largest = tf.cast(step.learning_rate, tf.float32), step.state.rule_state
            largest.assign(tf.where(ok, tf.maximum(largest, rate), largest))
        b1, b1c, correction_1 = self._first_moment_decay(t, rate, step.state.rule_state)
        # Each Python float is a new graph constant at each use: made once here (same values).
        epsilon = tf.constant(self.epsilon, tf.float32)
        relative_epsilon = self._relative_epsilon(rate, step.state.rule_state)
        b2, b2c, correction_2 = self._second_moment_decay(t)
        blocks = [(b, k, matrix, step.layer(b))
                  for b, k, matrix in block_matrices.gather(active, grads, variables, use_grads)]
        # Blocks of one shape (moments and both bases) are rotated and updated as one stack: a
        # Transformer's query/key/value/output or a ResNet stage's repeated convolutions then
        # cost one product per side, and one set of elementwise ops, instead of one per block
        # (fewer ops to trace, optimize and run; the same values to float32 round-off).
        groups = {}
        for n, (_, _, _, held) in enumerate(blocks):
            groups.setdefault(self._stack_key(held), []).append(n)
        steps = [None] * len(blocks)
        for members in groups.values():
            helds = [blocks[n][3] for n in members]
            stacked = len(members) > 1
            pack = (lambda ts: tf.stack(ts)) if stacked else (lambda ts: ts[0])
            q_a = pack([tf.convert_to_tensor(h.Q_A) for h in helds])
            q_g = pack([tf.convert_to_tensor(h.Q_G) for h in helds])
            rotated = rotate_in(pack([blocks[n][2] for n in members]), q_a, q_g)  # Q_Aᵀ M Q_G
            m_old = pack([tf.convert_to_tensor(h.m) for h in helds])  # read once
            v_old = pack([tf.convert_to_tensor(h.v) for h in helds])
            m = b1 * m_old + b1c * rotated
            v = b2 * v_old + b2c * tf.square(rotated)
            kept_m, kept_v = tf.where(ok, m, m_old), tf.where(ok, v, v_old)
            for h, new_m, new_v in zip(helds, *((tf.unstack(t) for t in (kept_m, kept_v))
                                                if stacked else ([kept_m], [kept_v]))):
                h.m.assign(new_m)
                h.v.assign(new_v)
            # ε relative to the block's RMS rotated gradient as well: a direction without gradient
            # (a softmax's all-ones logit direction, A's null space at its own batch) gets float32
            # round-off of the rotation (~1e-6 of the RMS) that Adam's division would blow up
            # to a full-size step, different on every device and replica count.
            v_hat = v / correction_2
            rms = tf.sqrt(tf.reduce_mean(v_hat, axis=[-2, -1], keepdims=True) if stacked
                          else tf.reduce_mean(v_hat))
            m_hat, root = m / correction_1, tf.sqrt(v_hat)
            delta = m_hat / (root + (epsilon + relative_epsilon * rms))
            if self.step_norm_epsilon is not None:
                sized = m_hat / (root + (epsilon + self.step_norm_epsilon * rms))
                delta = delta * tf.math.divide_no_nan(_frobenius(sized, stacked),
                                                      _frobenius(delta, stacked))
            delta = rotate_out(delta, q_a, q_g)  # Q_A Δ' Q_Gᵀ
            for n, u in zip(members, tf.unstack(delta) if stacked else [delta]):
                steps[n] = (blocks[n][0], blocks[n][1], u)
        if self.step == "orthogonal":
            chosen = [n for n, (b, _, _) in enumerate(steps) if b.kind not in self.adam_kinds]
            orthos = self._orthogonalized([steps[n][2] for n in chosen],
                                          rate, step.state.rule_state)
            if self.neuron_norm is not None:
                decay = tuple(tf.constant(value, tf.float32)
                              for value in (self.beta_2, 1.0 - self.beta_2))
                orthos = [self._neuron_normalized(u, blocks[n][3].neuron_v, ok, decay, epsilon)
                          for n, u in zip(chosen, orthos)]
            for n, u in zip(chosen, orthos):
                steps[n] = steps[n][:2] + (u,)
        out, written = block_matrices.scatter(grads, variables, steps)
        adam = (correction_1, correction_2, epsilon, b1, b1c, b2, b2c)
        for k, direction in self._first_order_adam(step, grads, variables, written,
                                                   adam).items():
            out[k] = direction
            written.add(k)
        return out, written  # marked: already a step (update_step adds decay and the rate)

    #: The stacked Adam of the variables without a block (:func:`thor_tf.rules.adam_step.
    #: stacked_adam_directions`), an attribute so that a test can watch its calls.
    _first_order_adam = staticmethod(stacked_adam_directions)

    @staticmethod
    def _stack_key(held):
        """Blocks with equal keys are preconditioned, and their moments carried into new bases, as
        one stack: the shapes of the moments (``[a_dim, g_dim]``) and of both bases
        (``[nb, d, d]``)."""
        return tuple(held.m.shape), tuple(held.Q_A.shape), tuple(held.Q_G.shape)

    def _neuron_axis(self, a_dim, g_dim):
        """The axis of a ``[a_dim, g_dim]`` step that :attr:`neuron_norm` averages over (0: one
        moment per output unit, a column; 1: one per input feature, a row)."""
        return 1 if self.neuron_norm == "long" and a_dim > g_dim else 0

    def _neuron_length(self, a_dim, g_dim):
        return (a_dim, g_dim)[1 - self._neuron_axis(a_dim, g_dim)]

    def _neuron_normalized(self, update, moment, ok, decay, epsilon):
        """NorMuon's normalization of one orthogonal ``[a_dim, g_dim]`` step (module docstring):
        ``moment`` (``[k]``, the variable) takes the step's squares at unit RMS, averaged over
        :meth:`_neuron_axis` (where ``ok``); the step is divided by its root per neuron and
        scaled back to its own Frobenius norm."""
        b2, b2c = decay
        axis = self._neuron_axis(*(int(d) for d in update.shape))
        norm = tf.sqrt(tf.reduce_sum(tf.square(update)))
        unit = update * (float(np.prod(update.shape)) ** 0.5 / (norm + 1e-30))
        old = tf.convert_to_tensor(moment)
        new = b2 * old + b2c * tf.reduce_mean(tf.square(unit), axis=axis)
        moment.assign(tf.where(ok, new, old))
        root = tf.sqrt(tf.expand_dims(new, axis)) + epsilon
        normalized = unit / root
        return normalized * (norm / (tf.sqrt(tf.reduce_sum(tf.square(normalized))) + 1e-30))

    def _orthogonalized(self, updates, rate=None, largest=None):
        """:func:`thor_tf.rules.orthogonal_step.orthogonalized` at this rule's ``scale``/``rms``
        and :attr:`newton_schulz_steps`; under :attr:`newton_schulz_steps_end` blended by
        ``η_t/η_max`` (``rate``, ``largest`` as :meth:`_first_moment_decay`'s; None: at the
        peak, a cost model's call)."""
        blend = None
        if self.newton_schulz_steps_end is not None:
            fraction = (tf.ones([], tf.float32) if rate is None
                        else _rate_fraction(rate, largest))
            blend = (self.newton_schulz_steps_end, fraction)
        return orthogonalized(updates, self.scale, self.rms, self.newton_schulz_steps, blend)

    # -- what a split costs and keeps ------------------------------------------------------------
    def split_cost(self):
        """:class:`EigenbasisSplitCost` of this rule's options."""
        return EigenbasisSplitCost(self)

    # -- the optimizer's chain ---------------------------------------------------------------------
    def update_step(self, optimizer, gradient, variable, learning_rate):
        """A block's step as it is, AdamW for the other variables; then ``w ← w − lr·(Δ + wd·w)``."""
        config = optimizer.config
        lr = ops.cast(learning_rate, variable.dtype)
        ok = optimizer.step_ok
        if isinstance(gradient, tf.IndexedSlices):
            gradient = tf.convert_to_tensor(gradient)
        update = ops.cast(gradient, variable.dtype)
        if not optimizer.marked(variable):
            m_var, v_var = optimizer.slot("adam_m", variable), optimizer.slot("adam_v", variable)
            # Bias corrections, ε and the decays: once per step for all variables (graph size:
            # a Python float is a new constant at each use; same values).
            correction_1, correction_2, epsilon, (b1, b1c, b2, b2c) = optimizer.once_per_apply(
                ("eigenbasis_adam", variable.dtype), lambda: self._adam_scalars(
                    optimizer, variable.dtype, learning_rate))
            m_old, v_old = tf.convert_to_tensor(m_var), tf.convert_to_tensor(v_var)  # read once
            m, v, update = adam_moments(update, m_old, v_old, ok,
                                 (correction_1, correction_2, epsilon, b1, b1c, b2, b2c))
            optimizer.assign(m_var, m)
            optimizer.assign(v_var, v)
        if config.weight_decay and _keras_compat.uses_weight_decay(optimizer, variable):
            decay = optimizer.once_per_apply(("weight_decay", variable.dtype), lambda: ops.cast(
                config.weight_decay, variable.dtype))
            update = update + decay * variable
        step = lr * update
        if ok is not None:
            # A skipped step's update may be NaN: select, never multiply by a zero rate. The
            # zero is one broadcast scalar for all variables (a zeros_like is an op per variable).
            zero = optimizer.once_per_apply(("zero", variable.dtype),
                                            lambda: tf.zeros([], variable.dtype))
            step = tf.where(ok, step, zero)
        optimizer.assign_sub(variable, step)

    def _adam_scalars(self, optimizer, dtype, learning_rate=None):
        """``(1 − β1ᵗ, 1 − β2ᵗ, ε, (β1, 1 − β1, β2, 1 − β2))`` in ``dtype`` at this step
        (``t`` = iterations + 1; the bias corrections and decays of :meth:`_first_moment_decay`
        and :meth:`_second_moment_decay`)."""
        t = ops.cast(optimizer.iterations + 1, dtype)
        b2, b2c, correction_2 = self._second_moment_decay(t)
        rate = None if self.beta_1_end is None else ops.cast(learning_rate, dtype)
        b1, b1c, correction_1 = self._first_moment_decay(t, rate,
                                                         optimizer.engine.state.rule_state)
        return correction_1, correction_2, ops.cast(self.epsilon, dtype), (b1, b1c, b2, b2c)

    def _first_moment_decay(self, t, rate=None, largest=None):
        """``(β1_t, 1 − β1_t, bias correction)`` at step ``t`` (a float tensor, from 1):
        ``(β1, 1 − β1, 1 − β1ᵗ)``, or under ``beta_1_end`` ``e`` with this step's ``rate`` and
        ``largest`` (the variable of the largest rate so far; read here, so the step's own rate
        is taken into it whether or not ``precondition``'s assignment ran first):
        ``β1_t = min(e + (β1 − e)·η_t/η_max, 1 − 1/t)`` and a correction of 1 (``β1_1 = 0``
        zeroes the product)."""
        dtype = t.dtype
        if self.beta_1_end is None:
            b1 = tf.constant(self.beta_1, dtype)
            return b1, tf.constant(1.0 - self.beta_1, dtype), 1.0 - tf.pow(b1, t)
        fraction = _rate_fraction(rate, largest)
        b1 = tf.constant(self.beta_1_end, dtype) + tf.constant(
            self.beta_1 - self.beta_1_end, dtype) * fraction
        b1 = tf.minimum(b1, 1.0 - 1.0 / t)
        return b1, 1.0 - b1, tf.ones([], dtype)

    def _relative_epsilon(self, rate=None, largest=None):
        """``ε_r`` at this step (a float32 scalar): ``relative_epsilon``, or under
        ``relative_epsilon_end`` ``e + (ε_r − e)·η_t/η_max`` with ``η_max`` as in
        :meth:`_first_moment_decay` (the step's own rate counted in it)."""
        if self.relative_epsilon_end is None:
            return tf.constant(self.relative_epsilon, tf.float32)
        fraction = _rate_fraction(rate, largest)
        return tf.constant(self.relative_epsilon_end, tf.float32) + tf.constant(
            self.relative_epsilon - self.relative_epsilon_end, tf.float32) * fraction

    def _second_moment_decay(self, t):
        """``(β2_t, 1 − β2_t, bias correction 1 − Π β2)`` at step ``t`` (a float tensor, from 1):
        ``(β2, 1 − β2, 1 − β2ᵗ)``, or under ``beta_2_growth`` ``c``: ``β2_t = min(β2, 1 − t^−c)``
        and a correction of 1 (``β2_1 = 0`` zeroes the product)."""
        dtype = t.dtype
        if self.beta_2_growth is None:
            b2 = tf.constant(self.beta_2, dtype)
            return b2, tf.constant(1.0 - self.beta_2, dtype), 1.0 - tf.pow(b2, t)
        b2 = tf.minimum(tf.constant(self.beta_2, dtype),
                        1.0 - tf.pow(t, tf.constant(-self.beta_2_growth, dtype)))
        return b2, 1.0 - b2, tf.ones([], dtype)


def _rate_fraction(rate, largest):
    """``η_t/η_max``: this step's ``rate`` over the larger of it and ``largest`` (the variable of
    the largest rate so far, read here, so the step's own rate counts whether or not
    ``precondition``'s assignment ran first); 0 while both are 0."""
    return tf.math.divide_no_nan(rate, tf.maximum(tf.cast(largest, rate.dtype), rate))


def _none_or_nonnegative(name, value):
    """``value`` as a float, or None; a ValueError naming ``name`` unless it is None or a
    number >= 0."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise ValueError(f"`{name}` must be None or a float >= 0; got {value!r}.")
    return float(value)


def _frobenius(matrices, stacked):
    """The Frobenius norm of a ``[a, g]`` matrix, or of each of a stack's (``[n, 1, 1]``)."""
    return tf.sqrt(tf.reduce_sum(tf.square(matrices), axis=[-2, -1], keepdims=stacked))


class EigenbasisSplitCost(SplitCost):
    """What a split costs the eigenbasis rule and what it keeps (:meth:`Eigenbasis.split_cost`)."""

    #: Where no candidate's information reaches its speed (factors wider than every affordable
    #: split: the held-out measure grows like b/n there), the measure cannot tell what the split
    #: does to training: leaving such sides unrotated took the deep autoencoder to its target in
    #: 37 steps instead of 56 but cost the Fashion CNN 0.45 points (docs/split_dim.md). The
    #: calibration then keeps the default split.
    fallback = "default"

    def __init__(self, rule):
        self.rule = rule

    def side_work(self, factor, previous, split, other_dim, side):
        """Per step: the side's rotations into its split basis and back (:func:`rotate_in` and
        :func:`rotate_out` with the other side unrotated); Adam's moments and Newton–Schulz are
        the same at every split and left out. Per refresh: the basis renewed from ``factor``'s
        blocks by this rule's ``refresh`` (a power step and QR from ``previous``'s basis, with
        its checks and ``eigh`` fallback, or ``eigh``), as :meth:`Eigenbasis.refresh` runs it."""
        rule = self.rule
        n = int(np.shape(factor)[0])
        matrix = side_matrix(n, other_dim, side)
        blocks, mask = split_blocks(factor, split)
        q_old, w_old = eigh_blocks(*split_blocks(previous, split), tie_break=rule.tie_break)
        one = tf.ones([1, 1, 1])  # a side of 1×1 blocks is not rotated

        def rotations(m, q):
            q_a, q_g = (q, one) if side == "A" else (one, q)
            return rotate_out(rotate_in(m, q_a, q_g), q_a, q_g)

        def renew(blocks, mask, q, w):
            selected = tf.ones(tf.shape(blocks)[:1], tf.bool)
            return refresh_selected(blocks, mask, q, w, selected, rule.refresh_method,
                                    rule.tie_break, rule.refresh_tolerance, rule.drift_tolerance,
                                    rule.refresh_min_size)[:2]

        return SideWork(step=(rotations, (matrix, q_old)),
                        refresh=(renew, (blocks, mask, q_old, w_old)))

    def fixed_work(self, shapes):
        """Adam's moments and division on every block's ``[a_dim, g_dim]`` matrix and, under
        ``step="orthogonal"``, their Newton–Schulz orthogonalization as
        :meth:`Eigenbasis.precondition` batches it."""
        rule = self.rule
        matrices = tuple(side_matrix(a, g, "A", seed=k) for k, (a, g) in enumerate(shapes))

        def step(*grads):
            b1, b2, eps = (tf.constant(v, tf.float32) for v in (rule.beta_1, rule.beta_2,
                                                                rule.epsilon))
            updates = []
            for g in grads:
                m = b1 * g + (1.0 - b1) * g
                v = b2 * tf.square(g) + (1.0 - b2) * tf.square(g)
                updates.append(m / (tf.sqrt(v) + eps))
            if rule.step == "orthogonal":
                updates = rule._orthogonalized(updates)
            return updates

        return step, matrices

    def information_curve(self, pairs, cands):
        """How well a split basis from one batch's factor diagonalizes the next batch's
        (:func:`thor_tf.split.information.kept_curve`), relative to the unsplit basis: its own
        held-out value when the unsplit factor is a candidate, else 1 (what it keeps of its own
        batch; an ``n³`` decomposition of a wide factor is not worth timing for)."""
        kept = kept_curve(pairs, cands)
        dim = int(np.shape(pairs[0][0])[0])
        reference = kept[-1] if cands[-1] >= dim and kept[-1] > 0 else 1.0
        return [min(1.0, k / reference) for k in kept]


def _clip(gradient, clip_norm):
    if isinstance(gradient, tf.IndexedSlices):
        gradient = tf.convert_to_tensor(gradient)
    return tf.clip_by_norm(gradient, clip_norm)
