"""Which blocks an engine trains (:class:`BlockSelection`, one of
:class:`~thor_tf.engine.ThorEngine`'s bases): the layer hooks installed once at wrap, the blocks
chosen per ``compile`` among the candidates (:mod:`thor_tf.discovery` finds them) for the
variables the optimizer trains, the one warning on layers without a block, and the
registration table.
"""

from __future__ import annotations

import warnings

from thor_tf import capture, discovery


class BlockSelection:
    """The selection half of the engine (a mixin: it uses the engine's ``model``,
    ``candidates``, ``store``, ``config``, ``options`` and ``_state``)."""

    def install_hooks(self):
        """Hook every candidate layer once (its blocks together): a layer frozen at wrap and
        unfrozen later gets its block at the next compile without a second hook."""
        by_layer = {}
        for block in self.candidates:
            by_layer.setdefault(id(block.layer), []).append(block)
        for blocks in by_layer.values():
            capture.install(blocks, self.store)

    def warn_unsupported(self):
        """One warning naming the layers that train first order for want of a block type (not
        those expected to: normalization, excluded layers)."""
        unsupported = [
            f"{layer.name} ({type(layer).__name__}: {reason})"
            for layer, reason in self.first_order
            if not isinstance(layer, discovery.EXPECTED_FIRST_ORDER) and reason != "excluded"
        ]
        if unsupported:
            warnings.warn(
                "thor_tf: no Kronecker block for " + ", ".join(unsupported)
                + "; these layers get the update rule's first-order step (AdamW under the "
                "default eigenbasis rule, momentum SGD under the inverse rule).",
                stacklevel=5)  # the user's thor_tf.wrap(...) line

    def select_blocks(self, trainable_variables):
        """Choose the blocks for the variables an optimizer trains: the candidates whose kernel is
        among ``trainable_variables`` (ordered as they are). Called at wrap, at every ``compile``
        and when the optimizer is built, so that freezing or unfreezing layers between compiles
        (transfer learning) changes which layers have blocks.

        Returns True when the selection differs from the last one shown (the table is due again).
        """
        if self._state is not None:
            raise ValueError("the THOR state exists already: blocks are chosen before the optimizer "
                             "is built (compile again after changing `trainable`)")
        index = {id(v): i for i, v in enumerate(trainable_variables)}
        blocks = sorted((b for b in self.candidates if id(b.kernel) in index),
                        key=lambda b: index[id(b.kernel)])
        chosen = {id(b) for b in blocks}
        self.blocks = blocks
        self.first_order = discovery.first_order_layers(
            self.model, self.candidates, self._structural_first_order, trainable_variables)
        self.frozen_layers = [b.layer for b in self.candidates if id(b) not in chosen]
        self._block_index = {b.name: i for i, b in enumerate(blocks)}
        selection = tuple(b.name for b in blocks)
        changed = selection != self._shown_selection
        self._shown_selection = selection
        return changed

    @property
    def split_dim(self):
        """The split in force (read, not held): the built optimizer's, else the options ``wrap``
        was given (None: the update rule's default; ``"auto"``: not chosen yet)."""
        config = self.config if self.config is not None else self.options
        return config.split_dim if config is not None else None

    def registration_table(self, split_dim=None):
        """The one table ``wrap`` prints: layers, block kinds, factor sizes, splits (``split_dim``,
        default the split in force), fallbacks."""
        return discovery.registration_table(self.blocks, self.first_order, self.frozen_layers,
                                            self.split_dim if split_dim is None else split_dim)

    def detach(self):
        """Take the layer hooks off: every layer's own ``call`` alone again."""
        for block in self.candidates:
            capture.uninstall(block.layer)
