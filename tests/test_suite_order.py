"""The order `make test` hands files to its two workers (conftest.py's LONGEST_FIRST) names files that exist: a
renamed or removed file would silently lose its place at the front, and a long file handed out last keeps one
worker busy alone at the end of the run."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _longest_first():
    spec = importlib.util.spec_from_file_location("root_conftest", ROOT / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LONGEST_FIRST


def test_every_file_put_first_exists_once():
    longest_first = _longest_first()
    assert [path for path in longest_first if not (ROOT / path).is_file()] == []
    assert len(set(longest_first)) == len(longest_first)
