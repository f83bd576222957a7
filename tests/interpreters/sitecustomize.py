"""Counts the fresh interpreters of a test run that import diffusers (conftest.py's budget).

conftest.py puts this folder on PYTHONPATH, so that every Python process the tests start (a torchrun rank, a Lab
engine or its fork server, a notebook's kernel, a CLI run) runs this first; with XDIT_LAB_DIFFUSERS_IMPORTS set to
a folder, the first import of diffusers in the process leaves a file there named by its pid. A fork of a process
that has imported diffusers imports nothing and is not counted: forks are what the budget pushes towards."""

import os
import sys

_FOLDER = os.environ.get("XDIT_LAB_DIFFUSERS_IMPORTS")


class _FirstDiffusersImport:
    def find_spec(self, name, path=None, target=None):
        if name == "diffusers":
            sys.meta_path.remove(self)
            try:
                with open(os.path.join(_FOLDER, str(os.getpid())), "w") as record:
                    record.write(" ".join(sys.argv)[:500])
            except OSError:  # the run that made the folder is over
                pass
        return None  # the import itself goes on as usual


if _FOLDER:
    sys.meta_path.insert(0, _FirstDiffusersImport())
