"""The README's commands as a newcomer types them: the first one leaves the tutorials runnable, and every shell
command it shows can be run from the clone as written (CI runs `make demo` and then tutorial 01 under nbconvert
from a fresh clone, .ci/run)."""

import ast
import re
import subprocess
import sys
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


def _blocks(language: str) -> list[str]:
    """The README's fenced code blocks of one language, in order."""
    return re.findall(rf"^```{language}\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)


def _commands() -> list[str]:
    """Each shell command the README shows: the lines of its bash blocks (continuations and comments left out)
    and the `$ ` lines of its output blocks."""
    found = []
    for block in _blocks("bash"):
        continued = False
        for line in block.splitlines():
            if line.strip() and not line.lstrip().startswith("#") and not continued:
                found.append(line.strip())
            continued = line.rstrip().endswith("\\")
    text = (ROOT / "README.md").read_text()
    return found + [line[2:] for line in text.splitlines() if line.startswith("$ ")]


def test_every_readme_command_runs_from_the_clone_as_written():
    """The Generating section showed bare `torchrun` (exit 127 without an activated venv) and `xdit-lab compare`,
    other sections `.venv/bin/...`. Every command now starts with `make` or a program that .venv/bin holds."""
    commands = _commands()
    assert any(c.startswith(".venv/bin/torchrun ") for c in commands), commands  # the list is read: the control
    for command in commands:
        program = command.split()[0]
        assert program == "make" or (program.startswith(".venv/bin/") and (ROOT / program).exists()), command


def test_the_lab_in_five_lines_runs_as_written(tmp_path):
    """The README's five-line Lab example, run as a newcomer pastes it: it draws, and rank 0's last step sent
    bytes in the ulysses group."""
    block = next(b for b in _blocks("python") if b.startswith("from xdit_lab import Lab, ParallelConfig\nlab = Lab(2)"))
    assert len(block.strip().splitlines()) == 5
    script = tmp_path / "five_lines.py"
    script.write_text(block + "lab.stop()\n")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    sent = ast.literal_eval(result.stdout.strip().splitlines()[-1])  # the dict the example prints
    assert sent["ulysses"] > 0, result.stdout


def test_the_comm_log_example_runs_under_torchrun_as_written(tmp_path):
    """The README's comm_log example, as a script under torchrun on 2 ranks: each rank prints the bytes it sent per
    group, in the ulysses group above all."""
    block = next(b for b in _blocks("python") if "with xdit_lab.comm_log() as log:" in b and "load_pipeline" in b)
    script = tmp_path / "script.py"
    script.write_text(block)
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    # the two ranks print to one pipe at once: a line may hold both, so the figures are found wherever they are
    sent = [int(n) for n in re.findall(r"'ulysses': (\d+)", result.stdout)]
    assert len(sent) == 2 and all(n > 0 for n in sent), result.stdout
