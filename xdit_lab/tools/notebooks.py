"""Save tutorials and notebooks executed, the way `make test` (nbval) compares them.

    python -m xdit_lab.tools.notebooks tutorials/02_ulysses.ipynb [...]     # or: make notebooks NB=...

Each notebook is run top to bottom on its own kernel (the `xdit-lab` kernel the Makefile
installs), in its own folder, and written back with its outputs, minus what cannot be kept:
widget state (large, different every run) and the widget views that would point at it (a saved
notebook cannot show a live widget). The file is replaced only after the whole run succeeded.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def strip_widgets(notebook) -> None:
    """Remove widget state and widget-view outputs from a notebook (an nbformat node), in place."""
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {})]


def save_executed(path, *, timeout_s: float = 600) -> None:
    import nbformat
    from nbclient import NotebookClient

    path = Path(path)
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=timeout_s, resources={"metadata": {"path": str(path.parent)}}).execute()
    strip_widgets(notebook)
    handle, temporary = tempfile.mkstemp(dir=path.parent, suffix=".ipynb.tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            nbformat.write(notebook, file)
        os.replace(temporary, path)  # atomic: a failed run never leaves half a notebook
    except BaseException:
        os.unlink(temporary)
        raise


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per cell")
    args = parser.parse_args(argv)
    for path in args.paths:
        print(f"executing {path}", file=sys.stderr)
        save_executed(path, timeout_s=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
