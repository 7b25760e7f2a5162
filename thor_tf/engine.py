"""``ThorEngine``: the data path of one wrapped model.

hooks (:mod:`thor_tf.capture`: each block layer's input, ``z`` and ``dL/dz``) → blocks (factors A,
G) → trace rule (:mod:`thor_tf.trace_rule`: refresh / reuse / freeze at cadence points) → refresh
(:mod:`thor_tf.refresh`: factors, then the update rule's inverses or bases) → preconditioning
(:mod:`thor_tf.rules`) → ``ThorOptimizer`` update.

Which layers have blocks is :mod:`thor_tf.discovery`'s business (at wrap, and per ``compile`` for
the variables the optimizer trains, so freezing and unfreezing layers between compiles works);
the read-outs (``layer_stats``, ``factors``, ...) are :mod:`thor_tf.introspection`'s. The engine
installs the hooks, holds the selection, and runs the step. Its settings are the optimizer's
:class:`~thor_tf.config.ThorConfig`; its state (:class:`~thor_tf.state.ThorState`: per-layer
factors and inverses, per-block statistics, counters) is created on, and saved with, the
optimizer.

The step has two entries with one body (:meth:`ThorEngine._step`): ``ThorModel.fit``'s own train
step (:meth:`ThorEngine.train_update`, which takes the gradients from its tape) and the user's
code (:meth:`ThorEngine.apply_gradients`, from ``ThorOptimizer.apply``). Either way, in stages:

1. the records of this step are taken from the hooks; under a strategy the gradients are
   all-reduced here, so that everything after is the global batch's (:mod:`thor_tf.distributed`);
2. at a due cadence point (:meth:`ThorEngine.curvature_step`): traces of the live layers →
   combined over replicas → the trace rule per layer (:func:`thor_tf.trace_rule.judge`) →
   factors and inverses of the refreshing layers (:meth:`thor_tf.refresh.Refresher.refresh`,
   combined over replicas first) → decisions recorded (:func:`thor_tf.trace_rule.record_decisions`);
3. preconditioning, the update rule's (:mod:`thor_tf.rules`): Adam in the eigenbasis of the
   split factors (the default), or THOR's ``(1/P)·A_inv·M·G_inv`` as one block-diagonal mat of
   Kronecker operators with K-FAC's KL clip (:mod:`thor_tf.rules.inverse_ops`);
4. the update (:meth:`thor_tf.optimizer.ThorOptimizer.apply_masked`), skipped on every replica
   when the loss or a gradient is not finite.
"""

from __future__ import annotations

import warnings

import tensorflow as tf

from thor_tf import _keras_compat, capture, discovery, distributed, fisher, loss_terms
from thor_tf.blocks import TiedLookupBlock
from thor_tf.cadence_point import CadencePoint, _valid_rows
from thor_tf.introspection import Introspection
from thor_tf.refresh import Refresher
from thor_tf.rules.step import Step
from thor_tf.selection import BlockSelection
from thor_tf.state import DecisionLog, ThorState


def _values(gradient):
    """The dense values of a gradient (``IndexedSlices`` from an embedding lookup: its rows)."""
    return gradient.values if isinstance(gradient, tf.IndexedSlices) else gradient


def _all_finite(tensor, axes):
    """Boolean scalar: every entry of ``tensor`` is finite. ``axes``: a dict of the reduction
    axes by rank, shared by the calls of one trace (the same values as ``tf.reduce_all`` without
    an axis, which makes a new axis constant at each call)."""
    rank = tensor.shape.rank
    if rank is None:
        return tf.reduce_all(tf.math.is_finite(tensor))
    if rank not in axes:
        axes[rank] = tf.constant(list(range(rank)), tf.int32)
    return tf.reduce_all(tf.math.is_finite(tensor), axis=axes[rank])


def _unscale(gradient, loss_scale):
    """``gradient / loss_scale`` (None passes through; ``IndexedSlices`` stay sparse)."""
    if gradient is None or loss_scale is None:
        return gradient
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values / tf.cast(loss_scale, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient / tf.cast(loss_scale, gradient.dtype)


class ThorEngine(BlockSelection, CadencePoint, Introspection):
    """Registry and per-step work for one model.

    Args:
      model: a built ``keras.Model`` (Sequential, Functional or subclassed; nesting allowed).
      exclude: layer names that should stay first order even if supported.
    """

    def __init__(self, model, exclude=(), options=None):
        # A model whose sub-models are built is enough (keras-io's GAN never calls itself).
        if not model.trainable_variables:
            raise ValueError(
                "`model` must be built (call it on data or give it an Input) and have trainable "
                "variables before thor_tf.wrap().")
        self.model = model
        self.store = capture.CaptureStore()
        loss_terms.install_observer()  # the terms of every Keras loss reduced under a tape
        self.optimizer = None
        self.config = None  # the optimizer's ThorConfig, from build_state on
        self.loss = None
        #: The ``LossScaleOptimizer`` around THOR (set by ``ThorModel.compile``), or None: the
        #: layer hooks' ``dL/dz`` carry its dynamic scale when the user's code applies gradients.
        self.loss_scaler = None
        #: The options ``wrap`` was given (:class:`thor_tf.config.ThorConfig`; the model's
        #: default optimizer is made from them); the optimizer's own from ``build_state`` on.
        self.options = options
        #: Print the registration table when the blocks change (set by ``wrap``'s ``verbose``).
        self.verbose = False
        self._exclude = list(exclude or ())
        discovery.check_exclude(model, self._exclude)
        hooked = [layer.name for layer in _keras_compat.flatten_layers(model)
                  if capture.is_installed(layer)]
        if hooked:
            raise ValueError(
                f"`model` is already wrapped (layers {hooked} record for another ThorModel); "
                f"wrap a model once, or call `wrapped.thor.detach()` before wrapping it again.")

        # Candidates: every layer with a block type and no structural reason against one,
        # trainable or not. They are all hooked once, here, so that a layer frozen at wrap time
        # and unfrozen later (transfer learning) gets its block at the next compile.
        self.candidates, self._structural_first_order = discovery.find_candidates(
            model, self._exclude)
        self.blocks, self.first_order, self.frozen_layers = [], [], []
        self._block_index = {}
        self._state = None
        self._shown_selection = None
        self._unmatched_warned = set()
        self.refresher = Refresher(self)
        #: The optimizer's class name when the model is compiled with a non-THOR optimizer.
        self.other_optimizer = None
        self.select_blocks(model.trainable_variables)

        self.warn_unsupported()
        self.install_hooks()

    # -- state -----------------------------------------------------------------------------------
    def build_state(self, optimizer, var_list):
        """Create the curvature state on ``optimizer`` (called from its ``build``)."""
        self.optimizer = optimizer
        #: The optimizer's validated options (:class:`thor_tf.config.ThorConfig`).
        self.config = optimizer.config
        if self.select_blocks(var_list) and self.verbose:
            print(self.registration_table(self.config.split_dim))
        self._state = ThorState.create(optimizer, self.blocks, self.config.split_dim,
                                       self.config.cadence.interval_base(), self.config.rule)
        #: The last cadence points' decisions, for TraceRuleLogger (telemetry, not saved).
        self.decision_log = DecisionLog(len(self.blocks))

    def reset_state(self):
        """Forget the state of a previous optimizer (``compile`` again: a new optimizer builds its
        own factors, inverses, counters and momentum, as Keras' optimizers do)."""
        self._state = None
        self.optimizer = None
        self.config = None
        self.decision_log = None

    @property
    def state(self):
        if self._state is None:
            if self.other_optimizer is not None:
                raise ValueError(
                    f"this model trains with {self.other_optimizer}, not THOR: there is no THOR "
                    f"state (compile without an optimizer, or with thor_tf.ThorOptimizer, to "
                    f"train with THOR)")
            raise ValueError("the THOR state does not exist yet: compile and fit (or build the "
                             "optimizer) first")
        return self._state

    def set_epoch(self, epoch):
        if self._state is not None:
            self._state.epoch.assign(int(epoch))

    # -- the per-step work (inside the traced train step) ---------------------------------------------
    def take_records(self, variables):
        """``{block name: [Record]}`` of this step for the blocks whose kernel is in ``variables``
        (taken from the layer hooks' store). A block whose calls were not all observed as it
        expects (``z`` not seen exactly once, or not of the block's shape: e.g. a tied embedding
        used as the output head) is left out: first order for this step, with one warning."""
        trained = {id(v) for v in variables}
        names = [b.name for b in self.blocks if id(b.kernel) in trained]
        records = self.store.take(names)
        for name in list(records):
            block = self.blocks[self._block_index[name]]
            if all(r.usable and block.matches(r) for r in records[name]):
                continue
            del records[name]
            if name not in self._unmatched_warned:
                self._unmatched_warned.add(name)
                warnings.warn(
                    f"thor_tf: a call of layer {name!r} did not compute its output as a "
                    f"{block.kind} block expects (its pre-activation was not observed once, or "
                    f"has another shape); its variables get the first-order update in such steps.",
                    stacklevel=4)
        return records

    def loss_terms(self, observed, batch_size, user_code):
        """The step's :class:`~thor_tf.loss_terms.LossTerms` (what one data point of the loss is).

        ``loss_reduction`` "mean" or "sum" says it (one term per example); "auto" (default) takes
        the terms of the Keras loss this step reduced (``observed``: ``fit``'s compiled loss, a
        ``compute_loss`` or a ``keras.losses.Loss`` the user's code called), else the compiled
        loss's reduction over examples in ``fit`` and a mean over examples in the user's code.
        """
        option = self.config.loss_reduction if self.config is not None else "auto"
        if option != "auto":
            return loss_terms.per_example(option, batch_size)
        if observed is not None:
            return observed
        if user_code or self.loss is None:
            return loss_terms.per_example("mean", batch_size)
        return loss_terms.per_example(fisher.loss_reduction(self.loss), batch_size)

    # Not converted by AutoGraph: the step's decisions are tensors already (tf.cond, tf.where),
    # and a custom loop's ``tf.function(model.train_step)`` would otherwise transpile the whole
    # step's Python (~500 functions: 15 s of a small CNN's first call, against ~1.5 s traced
    # under fit, whose train function Keras does not convert either).
    @tf.autograph.experimental.do_not_convert
    def train_update(self, tape, loss, variables, batch_size, loss_scale=None, sampled_loss=None,
                     terms=None):
        """Gradients, curvature update and THOR update for one batch (``ThorModel.fit``'s step).

        Args:
          tape: the GradientTape that recorded the forward pass (persistent for sampled Fisher).
          loss: the scaled training loss (what the gradients are taken of).
          variables: the model's trainable variables.
          batch_size: local batch size (scalar tensor).
          loss_scale: the factor ``loss`` was multiplied by (``loss_scale_factor`` and/or the
            dynamic scale of a ``LossScaleOptimizer``; float32 scalar tensor or None). Gradients
            and ``dL/dz`` are divided by it first, so that nothing downstream (preconditioning,
            KL clip, G) depends on the loss scale.
          sampled_loss: for ``fisher='sampled'``, the summed loss at sampled targets.
          terms: the loss's :class:`~thor_tf.loss_terms.LossTerms` as observed when it was
            reduced (None: from ``loss_reduction`` and the compiled loss).

        Returns:
          ``ok``: boolean scalar tensor, False when the loss or a gradient was non-finite (then no
          weight, momentum, factor, inverse, trace or counter other than ``nonfinite_steps``
          changed; the same on every replica).
        """
        # One backward pass: the parameter gradients and every dL/dz (recorded without the
        # backward hook in this step: the forward graph is the layers' own).
        records = self.take_records(variables)
        zs = [r for b in self.blocks if b.name in records for r in records[b.name]]
        all_grads = tape.gradient(loss, list(variables) + [r.z for r in zs])
        grads = all_grads[:len(variables)]
        for record, grad in zip(zs, all_grads[len(variables):]):
            record.grad = tf.zeros_like(record.z) if grad is None else grad

        def sampled_fn(active):
            # The second backward, of the loss at sampled targets (cadence points only).
            zs = [r.z for b in active for r in records[b.name]]
            gs = tape.gradient(sampled_loss, zs)
            return [tf.zeros_like(z, tf.float32) if g is None else tf.cast(g, tf.float32)
                    for z, g in zip(zs, gs)]

        return self._step(grads, variables, records, batch_size, grad_scale=loss_scale,
                          z_scale=loss_scale, loss=loss,
                          sampled_fn=sampled_fn if sampled_loss is not None else None,
                          terms=self.loss_terms(terms, batch_size, user_code=False))

    def apply_gradients(self, grads, variables):
        """THOR's step for gradients the user's own code computed (``optimizer.apply`` from a
        custom ``train_step``, a custom loop or a GAN): curvature from the layer hooks' records of
        this step, preconditioning, the update. Returns ``ok`` (see :meth:`train_update`).

        The loss's terms are those of the Keras loss the user's code reduced in this step
        (:mod:`thor_tf.loss_terms`), else as ``loss_reduction`` says ("mean" over the examples of
        the batch the first hooked layer saw, by default). Gradients are unscaled as Keras' ``apply`` would (by
        ``loss_scale_factor``; a ``LossScaleOptimizer`` around THOR unscales them itself), the
        hooks' ``dL/dz`` by the same factor or the ``LossScaleOptimizer``'s dynamic scale.
        """
        if self.config.fisher == "sampled":
            raise ValueError(
                "`fisher='sampled'` draws targets from the model's predictive distribution, which "
                "only ThorModel.fit's own train step knows; with your own train_step or loop use "
                "fisher='empirical' (the default).")
        records = self.take_records(variables)
        for taken in records.values():
            for record in taken:  # its output did not reach the loss: dL/dz = 0
                if record.grad is None:
                    record.grad = tf.zeros_like(record.z)
        first = next((records[b.name][0] for b in self.blocks if b.name in records), None)
        batch_size = tf.shape(first.inputs)[0] if first is not None else tf.constant(1)
        opt = self.optimizer
        if self.loss_scaler is not None:
            grad_scale, z_scale = None, tf.cast(self.loss_scaler.dynamic_scale, tf.float32)
        elif opt.loss_scale_factor is not None:
            grad_scale = z_scale = tf.constant(float(opt.loss_scale_factor), tf.float32)
        else:
            grad_scale = z_scale = None
        terms = self.loss_terms(loss_terms.take(), batch_size, user_code=True)
        return self._step(list(grads), variables, records, batch_size, grad_scale=grad_scale,
                          z_scale=z_scale, loss=None, sampled_fn=None, terms=terms)

    def _step(self, grads, variables, records, batch_size, grad_scale, z_scale, loss, sampled_fn,
              terms):
        """Stages 1-4 (module docstring) from the gradients and the hooks' records; ``terms``:
        the loss's :class:`~thor_tf.loss_terms.LossTerms`."""
        opt = self.optimizer
        active = [b for b in self.blocks if records.get(b.name)]
        grads = [_unscale(g, grad_scale) for g in grads]
        z_grads = [r.grad for b in active for r in records[b.name]]
        masks = {b.name: _row_masks(b, records[b.name], terms) for b in active}

        # Stage 1: the global batch's gradient (one all-reduce under a strategy; the loss rides
        # along so that a non-finite loss on any replica is seen by all, and under a mask so do
        # the counts of valid rows and terms). Everything after this is identical on every replica.
        loss_value = tf.constant(0.0) if loss is None else tf.reshape(tf.cast(loss, tf.float32), [])
        masked = [b for b in active if masks[b.name] is not None]
        counts = ([terms.count] + [_valid_rows(b, records[b.name], masks[b.name]) for b in masked]
                  if masked else [])
        # A tied embedding used both ways: its gradient split by use (the lookup's part summed
        # from the hooks' dL/dz, the head's the rest; reversible_embedding.py).
        tied = _tied_pairs(active)
        lookup_grads = [lookup.lookup_gradient(
            records[lookup.name], [_unscale(r.grad, z_scale) for r in records[lookup.name]])
            for lookup, _ in tied]
        n, m = len(grads), len(counts)
        reduced = distributed.sum_gradients(grads + [loss_value] + counts + lookup_grads)
        grads, loss_sum = reduced[:n], reduced[n]
        counts, lookup_grads = reduced[n + 1:n + 1 + m], reduced[n + 1 + m:]
        use_grads = {}
        index = {id(v): k for k, v in enumerate(variables)}
        for (lookup, head), lookup_grad in zip(tied, lookup_grads):
            whole = tf.convert_to_tensor(grads[index[id(lookup.kernel)]])
            use_grads[lookup.name] = lookup_grad
            use_grads[head.name] = tf.cast(whole, tf.float32) - lookup_grad
        rows_per_term = {}
        for b in active:
            if masks[b.name] is None:
                # R/D = (B·P)/(B·τ): KFC's P for a loss with one term per example.
                rows_per_term[b.name] = b.positions(records[b.name]) / terms.per_example
        for b, rows in zip(masked, counts[1:]):
            rows_per_term[b.name] = rows / tf.maximum(counts[0], 1.0)
        # Finite parameter gradients imply finite dL/dz (every dz enters a bias or kernel
        # gradient, and NaN·0 is NaN), so the large z-gradients need no check of their own.
        checks = [tf.math.is_finite(loss_sum)]
        axes = {}  # one constant per rank, not one per gradient (ResNet-50: 320 gradients)
        checks += [_all_finite(_values(g), axes) for g in grads if g is not None]
        ok = tf.reduce_all(tf.stack(checks))

        def split_by_block(tensors):
            out, k = {}, 0
            for b in active:
                count = len(records[b.name])
                out[b.name] = tensors[k:k + count]
                k += count
            return out

        def output_grads():
            # Built inside the cadence branch: no per-step work on the (large) z-gradients.
            scale = fisher.term_scale(terms.scale, z_scale)
            return split_by_block([tf.cast(g, tf.float32) * scale for g in z_grads])

        def sampled_output_grads():
            return split_by_block(sampled_fn(active))

        # Stage 2: curvature at a due cadence point. Stage 3: precondition. Stage 4: update.
        self.curvature_step(active, records, ok,
                            sampled_output_grads if sampled_fn is not None else output_grads,
                            batch_size, rows_per_term, masks)
        pre, marked = self.precondition(active, rows_per_term, grads, variables, ok, use_grads)
        state = self.state
        state.nonfinite_steps.assign_add(tf.cast(tf.logical_not(ok), tf.int64))
        opt.apply_masked(pre, variables, ok, [variables[k] for k in marked])
        return ok

    def precondition(self, active, rows_per_term, grads, variables, ok=True, use_grads=None):
        """``(gradients, marked)``: the blocks' steps from their gradients, the update rule's
        business (:meth:`thor_tf.rules.UpdateRule.precondition`; ``rows_per_term``: ``{block
        name: c}``; ``ok`` False: a skipped step, the rule's state stays as it is)."""
        return self.config.rule.precondition(self.rule_step(tf.convert_to_tensor(ok)), active,
                                             rows_per_term, grads, variables, use_grads)

    def rule_step(self, ok=True):
        """The :class:`~thor_tf.rules.step.Step` the update rule sees: all it gets of this
        engine and its optimizer (the one place that view is made)."""
        opt = self.optimizer
        return Step(self.state, self._block_index, opt.iterations, lambda: opt.learning_rate,
                    opt.slot, clip_norm=self.config.clip_norm, ok=ok)

    def block_position(self, name):
        """Index of block ``name`` in :attr:`blocks` and in the state's per-block vectors."""
        return self._block_index[name]


def _row_masks(block, records, terms):
    """Per record of ``block`` its row mask (:func:`thor_tf.loss_terms.row_mask`), or None when
    no record has one (every row counts: the unmasked code path)."""
    masks = [loss_terms.row_mask(terms, r.z, block.mask_width) for r in records]
    return None if all(m is None for m in masks) else masks


def _tied_pairs(active):
    """``[(TiedLookupBlock, TiedHeadBlock)]`` of the layers used both ways in this step."""
    pairs = []
    for block in active:
        if isinstance(block, TiedLookupBlock):
            head = block.tied_head(active)
            if head is not None:
                pairs.append((block, head))
    return pairs
