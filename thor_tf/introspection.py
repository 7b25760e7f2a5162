"""What a user can read of THOR's state between steps: per-layer statistics, counters, factors
and inverses as NumPy arrays (host values: never called inside the traced step).

:class:`Introspection` is a mixin of :class:`thor_tf.engine.ThorEngine`, so that these read-outs
are ``model.thor.layer_stats()``, ``model.thor.factors(name)`` and so on.
"""

from __future__ import annotations

import tensorflow as tf

from thor_tf.block_diagonal import BlockDiagonal, split_layout
from thor_tf.split.plan import AUTO


class Introspection:
    """Read-outs of an engine's blocks and state (``self.blocks``, ``self.state``, ...)."""

    def layer_stats(self):
        """One dict per registered layer (host values; call between steps, not in the graph).

        ``split_a``/``split_g``: the diagonal block size A's and G's factor are kept in (the
        factor's dimension where it is not split, 1 where only its diagonal is kept: an
        eigenbasis side left unrotated), read from THOR's state once it is built, else what
        ``split_dim`` gives; None where ``split_dim="auto"`` has not chosen yet. The model's
        ``split_dim`` itself (an int or a plan) is an option: ``model.thor_optimizer.config``."""
        split = self.split_dim
        stats = []
        state = self._state
        for i, b in enumerate(self.blocks):
            row = dict(b.describe())
            row["split_a"], row["split_g"] = self._splits_in_use(i, b, split)
            if state is not None:
                row.update({
                    "refreshes": int(state.refreshes.numpy()[i]),
                    "reuses": int(state.reuses.numpy()[i]),
                    "last_refresh_step": int(state.last_refresh.numpy()[i]),
                    "frozen": bool(state.frozen.numpy()[i]),
                    "frozen_at_step": int(state.frozen_at.numpy()[i]),
                    "last_delta": float(state.last_delta.numpy()[i]),
                })
            else:
                row.update({"refreshes": 0, "reuses": 0, "last_refresh_step": -1, "frozen": False,
                            "frozen_at_step": -1, "last_delta": float("nan")})
            stats.append(row)
        return stats

    def _splits_in_use(self, i, block, split):
        """``(A's block size, G's)`` of block ``i`` (:meth:`layer_stats`)."""
        state = self._state
        if state is not None:
            held = state.layers[i]
            return int(held.A.shape[-1]), int(held.G.shape[-1])
        if split is None:  # wrap's default before compile: the rule's split
            split = self.config.rule.default_split if self.optimizer is not None else None
        if split is None or split == AUTO:
            # Not chosen yet; a factor diagonal by structure (Embedding's A) is 1 whatever it is.
            return tuple(1 if size == 1 else None for size in block.split_sizes(1 << 30))
        return tuple(split_layout(dim, size)[1] for dim, size in
                     zip((block.a_dim, block.g_dim), block.split_sizes(split)))

    def curvature_to_damping(self):
        """``{name: (tr G / g_dim) / √λ}`` of the refreshed layers' factors in use (host values):
        G's mean eigenvalue against the per-factor damping (for P = 1). G grows with the square
        of a constant factor on the loss (it is the empirical Fisher), the damping does not."""
        s = self.state
        damping = float(self.optimizer.current_damping().numpy()) ** 0.5
        traces, refreshes = s.trace_g.numpy(), s.refreshes.numpy()
        return {b.name: float(traces[i]) / b.g_dim / damping
                for i, b in enumerate(self.blocks) if refreshes[i] > 0}

    def counters(self):
        """Model-wide counters: cadence points, non-finite steps, next cadence step, epoch, the
        cadence interval in force (``interval``: the adaptive one, else the base), the number of
        layer evaluations skipped because their traces were not finite (``nonfinite_traces``), and
        the last step's KL-clip scale ν (1.0: not clipped)."""
        return self.state.counters()

    def factors(self, name):
        """``{"A": ndarray, "G": ndarray}``: the undamped factors in use for layer ``name``.

        ``[a_dim, a_dim]`` and ``[g_dim, g_dim]``. Only the diagonal blocks of ``split_dim`` are
        ever computed and used, so with ``split_dim`` below a factor's dimension the matrix is
        block-diagonal (zeros elsewhere); with ``split_dim >= dim`` it is the full factor. A factor
        diagonal by structure (stored as 1×1 blocks: Embedding's A, the token frequencies) comes
        back as its diagonal, a vector ``[dim]``, never as a V×V matrix.
        """
        i = self._index_of(name)
        s = self.state
        block = self.blocks[i]

        def dense(blocks, dim):
            blocks = tf.convert_to_tensor(blocks)
            if int(blocks.shape[-1]) == 1 and dim > 1:
                return blocks[:dim, 0, 0].numpy()
            return BlockDiagonal(blocks, dim).to_dense().numpy()

        return {"A": dense(s.layers[i].A, block.a_dim), "G": dense(s.layers[i].G, block.g_dim)}

    def _index_of(self, name):
        if name not in self._block_index:
            raise ValueError(f"`name` must be one of the registered layers {list(self._block_index)}; "
                             f"got {name!r}.")
        return self._block_index[name]

    def inverses(self, name):
        """``{"A_inv": [nb, d, d], "G_inv": [nb, d, d]}`` split inverses for layer ``name``
        (the inverse rule; :meth:`bases` under the eigenbasis rule)."""
        i = self._index_of(name)
        held = self.state.layers[i]
        if not hasattr(held, "A_inv"):
            raise ValueError(f"the {self.config.rule.name} update rule keeps no inverses; "
                             f"read its bases with bases({name!r})")
        return {"A_inv": held.A_inv.numpy(), "G_inv": held.G_inv.numpy()}

    def bases(self, name):
        """The eigenbasis rule's state of layer ``name``: ``{"Q_A": [nb, d, d], "w_A": [nb, d],
        "Q_G", "w_G", "m": [a_dim, g_dim], "v": [a_dim, g_dim]}`` (eigenvectors as columns),
        and ``"neuron_v": [k]`` under ``Eigenbasis(neuron_norm=...)``."""
        i = self._index_of(name)
        held = self.state.layers[i]
        if not hasattr(held, "Q_A"):
            raise ValueError(f"the {self.config.rule.name} update rule keeps no eigenbases; "
                             f"read its inverses with inverses({name!r})")
        found = {k: getattr(held, k).numpy() for k in ("Q_A", "w_A", "Q_G", "w_G", "m", "v")}
        if getattr(held, "neuron_v", None) is not None:
            found["neuron_v"] = held.neuron_v.numpy()
        return found
