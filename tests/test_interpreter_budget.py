"""make test's budget of fresh interpreters that import diffusers (conftest.py): the count is of what it says."""

import os
import subprocess
import sys
from pathlib import Path

COUNTER = Path(__file__).parent / "interpreters"


def _run(code: str, folder: Path) -> int:
    env = dict(os.environ, XDIT_LAB_DIFFUSERS_IMPORTS=str(folder), PYTHONPATH=str(COUNTER))
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=120, check=True).returncode


def test_a_fresh_interpreter_importing_diffusers_is_counted_once_and_its_fork_not(tmp_path):
    fork_then_import = (
        "import os, diffusers, diffusers.models\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    import diffusers.pipelines\n"  # a fork of a process that imported it: nothing more to count
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    _run(fork_then_import, tmp_path)
    assert len(os.listdir(tmp_path)) == 1
    _run("import torch", tmp_path)  # control: no diffusers, not counted
    assert len(os.listdir(tmp_path)) == 1


def test_the_suite_s_processes_are_counted():
    """The tests' own environment carries the counter to every process they start (set before the workers start)."""
    assert str(COUNTER) in os.environ["PYTHONPATH"].split(os.pathsep)
    assert os.path.isdir(os.environ["XDIT_LAB_DIFFUSERS_IMPORTS"])
