"""The GPU tier: tests marked `cuda`, run by `make gpu-check` on a machine with CUDA GPUs.

Without CUDA every test here is skipped, with a reason that says so; a test that needs more
GPUs than are visible is skipped with the count it needs. A skip proves nothing: the table that
`make gpu-check` prints lists skips as SKIPPED, never as passed.

The table (one row per test: what ran, on what, the result and its figures) is printed at the end
of the session and written to $XDIT_LAB_GPU_REPORT (make gpu-check: outputs/gpu-check.md) when
that variable is set. Tests add figures with the `figures` fixture: figures(max_error=3e-4).
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def no_gpu_reason(count: int) -> str:
    if GPUS == 0:
        hidden = os.environ.get("CUDA_VISIBLE_DEVICES") == ""
        why = (
            "GPUs are hidden (CUDA_VISIBLE_DEVICES='', as make test sets)"
            if hidden
            else f"CUDA is not available (torch {torch.__version__}"
            f"{', a CPU build' if torch.version.cuda is None else ''}, or no GPU)"
        )
        return f"{why}: this GPU test did not run; run make gpu-check on a machine with CUDA GPUs"
    return f"needs {count} GPUs, {GPUS} visible: this test did not run"


def pytest_collection_modifyitems(config, items):
    """Every test here is marked cuda, and skipped with its reason where its GPUs are missing
    (a module says how many it needs with `GPUS_NEEDED = n`)."""
    for item in items:
        if "tests/gpu/" not in item.nodeid.replace(os.sep, "/"):
            continue
        count = getattr(item.module, "GPUS_NEEDED", 1)
        item.add_marker(pytest.mark.cuda)
        if GPUS < count:
            item.add_marker(pytest.mark.skip(reason=no_gpu_reason(count)))


@pytest.fixture
def figures(request):
    """Record figures (max errors, bytes, seconds) of this test for the table."""
    recorded = {}
    request.node.user_properties.append(("figures", recorded))

    def record(**values):
        recorded.update(values)

    return record


# ---- the table -------------------------------------------------------------------------------------

_ROWS: list[dict] = []


def pytest_runtest_logreport(report):
    if "tests/gpu/" not in report.nodeid.replace(os.sep, "/"):
        return
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        figures = next((value for key, value in report.user_properties if key == "figures"), {})
        if report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            result = f"SKIPPED: {reason.removeprefix('Skipped: ')}"
        elif report.failed:
            message = report.longreprtext.strip().splitlines()
            result = f"FAILED ({report.when}): {message[-1][:160] if message else ''}"
        else:
            result = "passed"
        _ROWS.append(
            dict(test=report.nodeid.split("tests/gpu/", 1)[-1], result=result, seconds=report.duration, figures=figures)
        )


def _machine() -> str:
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda or '-'}, {GPUS} visible GPU(s)"]
    for index in range(GPUS):
        props = torch.cuda.get_device_properties(index)
        lines.append(
            f"cuda:{index} {props.name} (capability {props.major}.{props.minor}, {props.total_memory / 2**30:.0f} GiB)"
        )
    try:
        import diffusers

        lines.append(f"diffusers {diffusers.__version__}")
    except ImportError:
        lines.append("diffusers not installed")
    return "; ".join(lines)


def _figures(values: dict) -> str:
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def table() -> str:
    counts = {kind: sum(r["result"].startswith(kind) for r in _ROWS) for kind in ("passed", "FAILED", "SKIPPED")}
    lines = [
        f"GPU check, {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"machine: {_machine()}",
        "",
        "| test | result | seconds | figures |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {r['test']} | {r['result']} | {r['seconds']:.1f} | {_figures(r['figures'])} |" for r in _ROWS]
    lines += [
        "",
        f"{counts['passed']} passed, {counts['FAILED']} failed, {counts['SKIPPED']} skipped "
        f"(a skipped test did not run and proves nothing)",
    ]
    return "\n".join(lines)


def pytest_terminal_summary(terminalreporter):
    if not _ROWS or not (GPUS or os.environ.get("XDIT_LAB_GPU_REPORT")):
        return  # make test on a CPU machine: the skips and their reasons are in pytest's own summary
    text = table()
    terminalreporter.write_sep("=", "GPU check")
    terminalreporter.write_line(text)
    target = os.environ.get("XDIT_LAB_GPU_REPORT")
    if target:
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(text + "\n")
        partial.replace(path)  # never a half-written report
        terminalreporter.write_line(f"table written to {path}")
