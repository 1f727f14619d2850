"""The slow tier's time budget (tests/budget.py) keeps its own file honest."""

from tests.budget import gone


def test_an_entry_whose_test_no_longer_exists_is_named(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_kept(x):\n    pass\n\n\ndef test_kept_longer():\n    pass\n")
    declared = {
        "tests/test_a.py::test_kept[1-2]": 1.0,  # a parametrised case: its function is there
        "tests/test_a.py::test_kept_longer": 1.0,
        "tests/test_a.py::test_renamed": 2.0,
        "tests/test_gone.py::test_x": 3.0,
    }
    assert gone(declared, tmp_path) == ["tests/test_a.py::test_renamed", "tests/test_gone.py::test_x"]
