"""The instruction counts docs/benchmarks.md shows are the code's: measured again here, each
within bench/figures.py's tolerance of the generated block (`make bench` writes it first)."""
import shutil

import pytest

import figures


@pytest.mark.skipif(not shutil.which("valgrind"), reason="valgrind not installed")
def test_the_documented_instruction_counts_are_todays(benchmark):
    found = figures.block(figures.DOC.read_text())
    assert found, f"{figures.DOC}: no generated block"
    measured = figures.measure()
    bad = figures.drift(figures.parse(found), measured)
    assert not bad, (f"docs/benchmarks.md's figures differ from the code's: {bad}; run "
                     "`.venv/bin/python bench/figures.py --write` and say in the docs what changed")
    benchmark.extra_info.update({row: added for row, _, _, added in measured})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def test_a_drifted_figure_is_caught_and_a_close_one_is_not():
    measured = [("a", 600, 1300, 700), ("b", 10000, 10280, 280)]
    assert figures.drift(figures.parse(figures.render(measured)), measured) == []
    documented = figures.parse(figures.render([("a", 600, 1000, 400), ("b", 10000, 10270, 270)]))
    assert figures.drift(documented, measured) == [("a", 400, 700)]      # b: within 5%
