"""``reports.md_table``, the one markdown table writer of the experiments' reports: its exact
lines, and a row of the wrong length refused. No TensorFlow."""

import pytest

from experiments.reports import md_table


def test_exact_lines():
    assert md_table(("optimizer", "lr", "final"), [("thor", "0.03", "0.9812"),
                                                   ["adam", "0.001", ""]]) == [
        "| optimizer | lr | final |",
        "|---|---|---|",
        "| thor | 0.03 | 0.9812 |",
        "| adam | 0.001 |  |"]        # cells verbatim: an empty one is "|  |"


def test_no_rows_is_the_header_and_separator():
    assert md_table(["a"], []) == ["| a |", "|---|"]
    assert md_table(["a", "b"], iter([])) == ["| a | b |", "|---|---|"]


def test_a_row_of_the_wrong_length_is_refused_by_its_index_and_cells():
    with pytest.raises(ValueError, match=r"row 1 has 2 cells, the header 3 .*'adam', '0\.001'"):
        md_table(("optimizer", "lr", "final"), [("thor", "0.03", "0.98"), ("adam", "0.001")])
    with pytest.raises(ValueError, match="row 0 has 4 cells, the header 3"):
        md_table(("optimizer", "lr", "final"), [("thor", "0.03", "0.98", "extra")])
