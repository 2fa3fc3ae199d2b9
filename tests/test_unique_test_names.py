"""pytest's default import mode imports a test file by its basename (the test folders have no
``__init__.py``), so two files of one name in two folders fail collection the moment one
session collects both, as ``./steep test`` does with the whole suite (CI's lanes split the
folders, and would not notice)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_file_name_is_unique_across_the_suite() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert names["test_unique_test_names.py"] == 1
    assert [name for name, n in names.items() if n > 1] == []
