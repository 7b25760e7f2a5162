"""The tables' parts the drivers and the report share: the ``metrics.csv`` reader, the number
formatter and the markdown table writer."""

from __future__ import annotations

import csv
import math


def read_rows(path, text=("optimizer",), ints=(), columns=None):
    """The rows of a ``metrics.csv`` as dicts of typed values: the ``text`` columns as strings,
    the ``ints`` as ints, every other as a float; empty (or ``None``) is None. ``columns``: the
    columns every row gets (those an older file lacks, e.g. :data:`timing.CSV_COLUMNS`, are
    None)."""
    rows = []
    with open(path, newline="") as handle:
        for row in csv.DictReader(handle):
            parsed = dict.fromkeys(columns or ())
            for key, value in row.items():
                if key in text:
                    parsed[key] = value
                elif value in ("", "None", None):
                    parsed[key] = None
                elif key in ints:
                    parsed[key] = int(float(value))
                else:
                    parsed[key] = float(value)
            rows.append(parsed)
    return rows


def fmt(value, spec, none="never"):
    """``value`` formatted with ``spec``; ``none`` for None (a target never reached), "∞" for
    infinity. The one number formatter of the experiments' tables."""
    if value is None:
        return none
    return "∞" if value == math.inf else format(value, spec)


def md_table(header, rows):
    """A markdown table as lines: the header, the separator ``|---|---|...|`` (one ``---`` per
    column, no alignment marks) and one line per row; the header and each row are written
    ``"| " + " | ".join(cells) + " |"``. ``header``: the column titles; ``rows``: sequences of
    cells already formatted as text, written verbatim (an empty cell comes out as ``|  |``; a
    ``|`` in a cell would split it). The one markdown table writer of the experiments' reports;
    a row whose length differs from the header's raises ValueError."""
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for index, row in enumerate(rows):
        row = list(row)
        if len(row) != len(header):
            raise ValueError(f"md_table: row {index} has {len(row)} cells, the header "
                             f"{len(header)} ({' | '.join(header)}): {row!r}")
        lines.append("| " + " | ".join(row) + " |")
    return lines

