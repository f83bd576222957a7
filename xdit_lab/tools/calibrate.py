"""This machine's speed as one figure: the core-seconds a fresh process takes to load the bundled digits model
with stock diffusers and draw one image (imports included), on one torch thread.

    python -m xdit_lab.tools.calibrate      # prints e.g. "calibration: 6.1 core-s (AMD EPYC, 2 cores)"

`make test` prints it at its end: CI times recorded in tests/DURATIONS.md carry it, so that a run on a VM twice
as slow is told apart from a suite that grew. Stock diffusers on purpose: the figure does not move with this
package's code."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported: one core's speed

import resource  # noqa: E402
import time  # noqa: E402

START = time.monotonic()


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), and the cores this process may use."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model}, {cores} cores"


def main() -> None:
    from xdit_lab.digits.sample import draw_digits, load_digits_pipeline

    draw_digits(load_digits_pipeline(), [3], [0])
    usage = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.monotonic() - START
    print(f"calibration: {usage.ru_utime + usage.ru_stime:.1f} core-s ({cpu_model()}; {wall:.1f} s wall)")


if __name__ == "__main__":
    main()
