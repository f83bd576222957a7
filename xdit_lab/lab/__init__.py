"""The notebook Lab: ranks on ipyparallel engines, driven from cells (see cluster.py).

Importing this package starts nothing, and loads ipyparallel only when `Lab` is first used, so
the engines (which import lab.engine) and the pure views do not pay for the client."""

import importlib

_LAZY = {
    "Lab": "cluster",
    "LabError": "errors",
    "LabSession": "labsession",
    "ExplorerController": "explorer",
    "Explorer": "explorer_widgets",
}

__all__ = list(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'xdit_lab.lab' has no attribute {name!r}")
