"""The README's commands as a newcomer types them: the first one leaves the tutorials runnable, and every shell
command it shows can be run from the clone as written (CI runs `make demo` and then tutorial 01 under nbconvert
from a fresh clone, .ci/run)."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_make_demo_installs_the_notebooks_kernel(tmp_path):
    """`make demo` then a tutorial failed with NoSuchKernel: only `make setup` and `make test` installed the
    kernel the notebooks name. Asked where the kernel is missing (a path of its own), make demo installs it."""
    kernel = tmp_path / "kernels" / "xdit-lab" / "kernel.json"
    dry = subprocess.run(
        ["make", "-n", "demo", f"KERNEL={kernel}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    install = [i for i, line in enumerate(lines) if "ipykernel install" in line and "--name xdit-lab" in line]
    demo = [i for i, line in enumerate(lines) if line.endswith("xdit-lab demo")]
    assert install and demo and install[0] < demo[0], dry.stdout
    notebook = (ROOT / "tutorials" / "01_first_parallel_step.ipynb").read_text()
    assert re.search(r'"kernelspec":\s*{[^}]*"name":\s*"xdit-lab"', notebook)  # the kernel the tutorials ask for
