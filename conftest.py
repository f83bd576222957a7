"""pytest settings for the whole suite: the order the test files are handed out in, and nbval's wait for output.

`make test` runs tests/ and the notebooks in one pytest on two workers (pytest-xdist, one file at a time to a
worker, in the order collected): the longest files go first (LONGEST_FIRST), so that the last ones handed out are
short and neither worker idles long while the other finishes.

nbval re-runs the tutorials and notebooks (`make nbval`, or as part of `make test`).

nbval waits at most 5 s for each of a cell's output messages once the kernel has replied (a constant,
IPyNbCell.output_timeout, that no option sets). With pytest running beside nbval on CI's two cores, a
kernel's closing message came later than that after a cell had run to its end (tutorials/11, cell 4, in
the CI of 31a1f53): the cell failed as "Timeout of 5 seconds exceeded waiting for output" and every
later cell of the notebook with it. A slow machine is not a wrong tutorial, so the wait is longer here.
A hung cell is still bounded: by pytest-timeout's per-item limit (pyproject.toml) and nbval's
--nbval-cell-timeout.

What a run costs, told apart from how fast the VM is (printed at the end of every run, recorded in
tests/DURATIONS.md): the fresh interpreters that imported diffusers, against a budget committed here (a test that
starts a process for what a fork or an in-process call proves is caught where it is added); the core-seconds of
each file, its processes included; and the calibration figure of this machine (python -m xdit_lab.tools.calibrate)."""

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

# Long enough for a starved kernel, short enough that a dead one is reported well inside the item's limit.
NBVAL_OUTPUT_TIMEOUT_S = 60


# Files of a minute or more, longest first: seconds alone on the CI's two cores (tests/DURATIONS.md). Every other
# file follows in the order collected. A file missing here costs at most its own length at the end of the run.
LONGEST_FIRST = [
    "tests/test_lab_hosts.py",  # 280 s (b86ccdb's CI; the others below: estimates after #59's cuts)
    "tests/test_run_cli.py",  # 150
    "tests/test_image_conditioned_pipelines.py",  # 433 core-s, the most of any file (CI of 2857710)
    "tutorials/10_notebook_to_production.ipynb",  # 110
    "tests/test_pipelines.py",  # 97
    "tests/test_quantization.py",  # 90
    "tutorials/12_skipping_steps.ipynb",  # 80
    "tests/test_tp_options.py",  # 75 (an estimate: 164 core-s of forked ranks, measured beside other jobs)
    "tests/test_pipefusion.py",  # 70
    "tests/test_tp_pipefusion.py",  # 70 (an estimate: ~100 s beside other jobs, 4 forked ranks)
    "tests/test_step_cache.py",  # 65
    "tests/test_tensor_parallel.py",  # 65 (an estimate from its runs beside other jobs; tp is new)
    "tutorials/11_model_families.ipynb",  # 64
    "tutorials/06_pipefusion.ipynb",  # 61
    "tutorials/04_usp.ipynb",  # 61
    "tests/test_lab_robustness.py",  # 60
    "tests/test_gpu_true.py",  # 59
    "tests/test_prompts_file_runs.py",  # 55
    "tests/test_compile.py",  # 50
    "tests/test_lab.py",  # 50
]


# Fresh interpreters that import diffusers in one `make test` (tests/interpreters/sitecustomize.py counts them): the
# pytest workers, every notebook's kernel, every fork server of the Lab's engines, every torchrun rank and CLI run.
FRESH_DIFFUSERS_INTERPRETERS_BUDGET = 80


def _controller(config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's workers have it


def pytest_addoption(parser):
    parser.addoption(
        "--calibrate", action="store_true", help="print this machine's calibration figure at the end (make test)"
    )


def pytest_configure(config):
    if _controller(config):  # before the workers start: they and everything they start inherit the environment
        folder = tempfile.mkdtemp(prefix="xdit-lab-diffusers-imports-")
        config._diffusers_imports = folder
        os.environ["XDIT_LAB_DIFFUSERS_IMPORTS"] = folder
        here = str(Path(__file__).parent / "tests" / "interpreters")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    config._core_seconds = {}  # file -> core-seconds (this process's, and its descendants')
    config._current_file = None


def core_seconds() -> float:
    """CPU seconds of this process, its reaped children, and every live descendant (with what each reaped)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    for child in psutil.Process().children(recursive=True):
        try:
            times = child.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:  # ended meanwhile: its parent reaps it into the count above
            pass
    return total


def _close_file(config) -> None:
    if config._current_file is not None:
        name, started = config._current_file
        config._core_seconds[name] = config._core_seconds.get(name, 0.0) + core_seconds() - started
        config._current_file = None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    config, name = item.config, item.nodeid.split("::")[0]
    if config._current_file is None or config._current_file[0] != name:
        _close_file(config)
        config._current_file = (name, core_seconds())


def pytest_testnodedown(node, error):
    for name, seconds in json.loads(node.workeroutput.get("core_seconds", "{}")).items():
        node.config._core_seconds[name] = node.config._core_seconds.get(name, 0.0) + seconds


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    _close_file(config)
    if not _controller(config):
        config.workeroutput["core_seconds"] = json.dumps(config._core_seconds)
        return
    fresh = sorted(os.listdir(config._diffusers_imports))
    config._fresh_diffusers_interpreters = len(fresh)
    if len(fresh) > FRESH_DIFFUSERS_INTERPRETERS_BUDGET:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _controller(config):
        return
    write = terminalreporter.write_line
    files = sorted(config._core_seconds.items(), key=lambda item: -item[1])
    terminalreporter.section("core-seconds by file (processes included)")
    write(f"{sum(config._core_seconds.values()):.0f} core-s in all; files of 20 or more:")
    for name, seconds in files:
        if seconds >= 20:
            write(f"{seconds:7.0f}  {name}")
    count = config._fresh_diffusers_interpreters
    terminalreporter.section("fresh interpreters that imported diffusers")
    write(f"{count} (budget {FRESH_DIFFUSERS_INTERPRETERS_BUDGET}, conftest.py)")
    if count > FRESH_DIFFUSERS_INTERPRETERS_BUDGET:
        folder = config._diffusers_imports
        commands = sorted(Path(folder, pid).read_text() for pid in os.listdir(folder))
        write(
            "over the budget: a test starts a process where a fork or an in-process call would prove the same "
            "(forked ranks: xdit_lab.testing; the Lab's engines are forks). Their command lines:",
            red=True,
        )
        for command in commands:
            write(f"  {command}")
    shutil.rmtree(config._diffusers_imports, ignore_errors=True)
    if config.getoption("calibrate"):  # this machine's speed beside the run's times, measured with nothing else running
        env = {k: v for k, v in os.environ.items() if k != "XDIT_LAB_DIFFUSERS_IMPORTS"}
        calibration = subprocess.run(
            [sys.executable, "-m", "xdit_lab.tools.calibrate"], capture_output=True, text=True, timeout=300, env=env
        )
        write(((calibration.stdout or calibration.stderr).strip().splitlines() or ["calibration: no output"])[-1])


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # sorted() is stable: a file's own items keep their order, and the other files theirs
    items[:] = sorted(items, key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:  # nbval is a test extra; without it there are no notebook items
        return
    for item in items:
        if isinstance(item, IPyNbCell):
            item.output_timeout = NBVAL_OUTPUT_TIMEOUT_S
