"""experiments/tables.py: ``md_table`` (the one markdown table writer of the experiments'
reports: its exact lines, and a row of the wrong length refused), ``fmt`` and ``read_rows``.
No TensorFlow."""

import pytest

from experiments.tables import md_table


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


def test_fmt_says_never_for_none_and_infinity_as_such():
    from experiments.tables import fmt

    assert fmt(0.12345, ".3f") == "0.123" and fmt(1200, ",") == "1,200"
    assert fmt(None, ".3f") == "never" and fmt(None, ".3f", none="–") == "–"
    assert fmt(float("inf"), ".3f") == "∞"


def test_read_rows_types_the_columns_and_fills_missing_ones(tmp_path):
    from experiments.tables import read_rows

    path = tmp_path / "metrics.csv"
    path.write_text("optimizer,seed,step,metric,lr\nthor,0,10,0.5,\nadam,1,20.0,0.25,0.01\n")
    rows = read_rows(path, ints=("seed", "step"), columns=("optimizer", "seconds"))
    assert rows == [
        {"optimizer": "thor", "seconds": None, "seed": 0, "step": 10, "metric": 0.5, "lr": None},
        {"optimizer": "adam", "seconds": None, "seed": 1, "step": 20, "metric": 0.25, "lr": 0.01}]
    assert isinstance(rows[1]["step"], int)
