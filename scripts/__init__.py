"""Entry points that regenerate the records in ``docs/results/`` (``python scripts/<name>.py``),
each over the :mod:`experiments` harness. A package only so that the tests import them as
``scripts.<name>`` from a checkout; not installed."""
