"""pytest settings for nbval, which re-runs the tutorials and notebooks (`make nbval`).

nbval waits at most 5 s for each of a cell's output messages once the kernel has replied (a constant,
IPyNbCell.output_timeout, that no option sets). With pytest running beside nbval on CI's two cores, a
kernel's closing message came later than that after a cell had run to its end (tutorials/11, cell 4, in
the CI of 31a1f53): the cell failed as "Timeout of 5 seconds exceeded waiting for output" and every
later cell of the notebook with it. A slow machine is not a wrong tutorial, so the wait is longer here.
A hung cell is still bounded: by pytest-timeout's per-item limit (pyproject.toml) and nbval's
--nbval-cell-timeout."""

# Long enough for a starved kernel, short enough that a dead one is reported well inside the item's limit.
NBVAL_OUTPUT_TIMEOUT_S = 60


def pytest_collection_modifyitems(items):
    try:
        from nbval.plugin import IPyNbCell
    except ImportError:  # nbval is a test extra; without it there are no notebook items
        return
    for item in items:
        if isinstance(item, IPyNbCell):
            item.output_timeout = NBVAL_OUTPUT_TIMEOUT_S
