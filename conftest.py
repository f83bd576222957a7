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
--nbval-cell-timeout."""

# Long enough for a starved kernel, short enough that a dead one is reported well inside the item's limit.
NBVAL_OUTPUT_TIMEOUT_S = 60


# Files of a minute or more, longest first: seconds alone on the CI's two cores (tests/DURATIONS.md). Every other
# file follows in the order collected. A file missing here costs at most its own length at the end of the run.
LONGEST_FIRST = [
    "tests/test_lab_hosts.py",  # 190 s
    "tests/test_run_cli.py",  # 185
    "tutorials/10_notebook_to_production.ipynb",  # 113
    "tests/test_pipelines.py",  # 97
    "tests/test_quantization.py",  # 96
    "tests/test_compile.py",  # 89
    "tests/test_step_cache.py",  # 86
    "tests/test_lab.py",  # 83
    "tests/test_lab_robustness.py",  # 81
    "tutorials/12_skipping_steps.ipynb",  # 80
    "tutorials/14_fitting_a_big_model.ipynb",  # 75
    "tests/test_pipefusion.py",  # 70
    "tests/test_prompts_file_runs.py",  # 69
    "tutorials/11_model_families.ipynb",  # 64
    "tutorials/06_pipefusion.ipynb",  # 61
    "tutorials/04_usp.ipynb",  # 61
    "tests/test_gpu_true.py",  # 59
]


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
