"""No tracked file keeps a merge's conflict markers. Python only fails on markers in code; in a docstring, a
comment, a notebook's markdown or a Markdown file they pass every other check, and a reader gets both sides."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)
TEXT = (".py", ".md", ".ipynb", ".cfg", ".toml", ".json", ".txt", ".sh", ".yml", ".yaml")


def tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in names.splitlines() if name.endswith(TEXT) or name in ("Makefile", ".ci/run")]


def markers_in(text: str) -> list[str]:
    return [match.group(0) for match in MARKER.finditer(text)]


def test_no_tracked_file_keeps_conflict_markers():
    files = tracked_text_files()
    assert len(files) > 100  # the listing is the repository's, not an empty one
    found = {
        str(path.relative_to(ROOT)): markers_in(path.read_text(errors="replace")) for path in files if path.is_file()
    }
    assert {name: marks for name, marks in found.items() if marks} == {}


def test_the_markers_are_seen_where_a_merge_leaves_them():
    # the control: a docstring as a merge left one, and text that only resembles it
    left = '"""One.\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n"""\n'
    assert markers_in(left) == ["<<<<<<< ", "=======", ">>>>>>> "]
    assert markers_in("a = 1  # ======= a rule, not a marker\n<<<<<<<<< nine\n") == []
