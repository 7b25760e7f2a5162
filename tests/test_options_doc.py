"""docs/options.md against the declarations: every option `wrap` takes is in its table, every
row names an option that exists, and every default the table states as a literal is the one the
code declares (ThorConfig's fields, ThorModel's arguments, the rules' constructors), so the page
cannot drift from the code."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import thor_tf
from thor_tf import config, model, rules

DOC = (Path(__file__).resolve().parents[1] / "docs" / "options.md").read_text()


def _table(heading_pattern):
    """``{option: default cell}`` of the first table after the heading that matches."""
    start = re.search(heading_pattern, DOC).end()
    rows = {}
    for line in DOC[start:].splitlines():
        if not line.startswith("|"):
            if rows:
                break
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            rows[name] = cells[1]
    rows.pop("option", None)
    return rows


def _declared_options():
    """``{option: default}`` as the code declares them (``inspect.Parameter.empty`` where the
    default is not one value: a schedule, a per-rule plan)."""
    declared = {}
    for field in dataclasses.fields(config.ThorConfig):  # the rule's own: their table (below)
        declared[field.name] = field.default
    for field in dataclasses.fields(thor_tf.TraceRule):  # taken by name, in the same table
        declared[field.name] = field.default
    declared["update_rule"] = rules.DEFAULT_RULE
    declared["trace_rule"] = inspect.Parameter.empty  # an object: its options are the rows
    declared["split_dim"] = declared["learning_rate"] = inspect.Parameter.empty
    for name in ("exclude", "verbose", "graph_optimization"):
        declared[name] = inspect.signature(model.ThorModel.__init__).parameters[name].default
    return declared


def _literal(cell):
    """The cell's default as a Python value when it is one literal (``0.03``, ``"thor"``, ``None``,
    ``True``, possibly in backticks), else ``inspect.Parameter.empty``."""
    text = cell.strip().strip("`")
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return inspect.Parameter.empty


def test_every_option_is_documented_and_every_row_exists():
    documented = _table(r"# Options of `thor_tf.wrap`")
    declared = _declared_options()
    assert set(declared) - set(documented) == set(), "options missing from docs/options.md"
    assert set(documented) - set(declared) == set(), "rows of docs/options.md no option has"


@pytest.mark.parametrize("name", sorted(_declared_options()))
def test_documented_default_is_the_declared_one(name):
    documented = _literal(_table(r"# Options of `thor_tf.wrap`")[name])
    declared = _declared_options()[name]
    if name in ("omega1", "omega2"):  # "from preset": None declared, the preset decides
        assert declared is None
        return
    if documented is inspect.Parameter.empty or declared is inspect.Parameter.empty:
        # Not one literal on one side (a schedule, a per-rule plan): it must not be a literal on
        # the other either, or the two could disagree unseen.
        assert documented is inspect.Parameter.empty and (
            declared is inspect.Parameter.empty or name in ("frequency", "update_rule")), name
        return
    assert documented == declared, (name, documented, declared)


def test_frequency_and_update_rule_defaults_as_the_table_words_them():
    table = _table(r"# Options of `thor_tf.wrap`")
    assert _literal(table["frequency"]) == config.DEFAULT_FREQUENCY == 10
    assert _literal(table["update_rule"]) == rules.DEFAULT_RULE


def test_the_rules_option_tables_match_their_constructors():
    """The inverse rule's table (its options are also taken by name: config.RULE_OPTIONS) and the
    eigenbasis rule's call in the update_rule row against their constructors."""
    inverse = _table(r"\*\*`thor_tf.rules.Inverse`\*\*")
    signature = inspect.signature(rules.Inverse.__init__).parameters
    assert set(inverse) == set(signature) - {"self"} == set(config.RULE_OPTIONS)
    for name, cell in inverse.items():
        assert _literal(cell) == signature[name].default, name
    # The eigenbasis rule's options are written as a call in the update_rule row.
    call = re.search(r"`thor_tf\.rules\.Eigenbasis\(([^`]*)\)`", DOC).group(1)
    keywords = ast.parse(f"f({call})", mode="eval").body.keywords
    written = {k.arg: ast.literal_eval(k.value) for k in keywords}
    signature = inspect.signature(thor_tf.rules.Eigenbasis.__init__).parameters
    assert set(written) == set(signature) - {"self"}
    for name, value in written.items():
        default = signature[name].default
        if name == "relative_epsilon":  # None: 0.1 for the orthogonal step, 1e-4 for Adam's
            assert default is None and value == 0.1
            continue
        assert value == default, (name, value, default)
