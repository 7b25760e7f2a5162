"""The split dimension in one home: what a split is, what it keeps, what it costs, and the
calibration that weighs the two for the rule that trains (the H of THOR; DESIGN.md §2).

* :mod:`~thor_tf.split.plan`: ``split_dim`` as a model uses it (an int, a :class:`SplitPlan`
  per factor dimension, ``"auto"``), and :func:`split_size`, what the blocks call;
* :mod:`~thor_tf.split.information`: what a split keeps, per rule (the inverse rule's spectral
  loss, the eigenbasis rule's held-out diagonal mass); NumPy only, below the rules;
* :mod:`~thor_tf.split.crossing`: the candidates and the crossing of the two curves;
* :mod:`~thor_tf.split.timing`: seconds of traced work, round robin;
* :mod:`~thor_tf.split.probe`: full factors of a model's blocks on given batches;
* :mod:`~thor_tf.split.calibrate`: the calibration for any rule (``split_dim="auto"``,
  ``scripts/calibrate_split_dim.py``);
* :mod:`~thor_tf.split.inverse_calibration`: the seed's calibration of one split for the
  inverse rule, on a trained model's factors.

Only :mod:`~thor_tf.split.plan` is imported here: the rules import the information measures
and the calibration imports the rules.
"""

from thor_tf.split.plan import (AUTO, DEFAULT_SPLIT, SplitPlan, resolve_split_dim, split_config,
                                split_size)

__all__ = ["AUTO", "DEFAULT_SPLIT", "SplitPlan", "resolve_split_dim", "split_config", "split_size"]
