"""What a newcomer meets when `xdit-lab run` fails: one error line, said once however many ranks meet it, without
torchrun's traceback where the launch is ours (run as they run it: the console script with `--ranks`, and torch's
own `torchrun`); advice that fits the model's heads; a failed run that does not lock its output folder (its ranks
given torchrun's environment by run_cli, as what it proves is the folder's, not the launch's)."""

import json
import stat
import subprocess
import sys
from pathlib import Path

from xdit_lab.output_folder import atomic_write, check_output_folder
from xdit_lab.testing import run_cli

XDIT_LAB = str(Path(sys.executable).with_name("xdit-lab"))
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def _run(*args: str, command=(XDIT_LAB, "run", "--ranks", "2"), timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=timeout)


def _said(result) -> list[str]:
    """The error lines of a run's output (stdout and stderr; a finished process or a run_cli job)."""
    return [line for line in (result.stdout + result.stderr).splitlines() if "error:" in line]


def test_a_degree_the_heads_refuse_is_said_once_with_no_advice_into_another_error(tmp_path):
    """ulysses 8 on 2 ranks of the digits model (4 heads, fewer than 8 ranks): once a degree the heads refuse
    suggested launching its ranks, which then loaded for 17 s and failed on the heads. Now: one error, once, naming
    the heads and what fits 2 ranks, no advice to keep ulysses 8; no traceback; nothing left in --output. Control:
    ulysses 4 fits the heads, so keeping it on 4 ranks is advised."""
    output = tmp_path / "out"
    result = _run("--model", "digits", "--prompt", "a 7", "--ulysses", "8", "--output", str(output))
    assert result.returncode == 2, result.stderr
    assert len(_said(result)) == 1, result.stderr
    text = result.stdout + result.stderr
    assert "4 attention heads cannot give each of ulysses 8 ranks a head" in text and "fit 2 ranks" in text, text
    assert "nproc_per_node 8" not in text and "Traceback" not in text and "ChildFailedError" not in text, text
    assert not output.exists()

    control = _run("--model", "digits", "--prompt", "a 7", "--ulysses", "4", "--output", str(output))
    assert control.returncode == 2 and len(_said(control)) == 1, control.stderr
    assert "keep this configuration" in control.stderr and "nproc_per_node 4" in control.stderr, control.stderr


def test_plain_torchrun_says_our_error_once(tmp_path):
    """Under torch's own torchrun every rank meets the same unwritable --output: the line is printed once, not once
    per rank (torchrun's ChildFailedError after it is torch's, which `xdit-lab run --ranks` leaves out)."""
    result = _run(
        *"-m xdit_lab.cli run --model digits --ulysses 2 --output /proc/no-such-folder --prompt".split(),
        "a 7",
        command=(TORCHRUN, "--standalone", "--nproc_per_node", "2"),
    )
    assert result.returncode != 0
    ours = [line for line in _said(result) if line.startswith("xdit-lab run: error:")]
    assert len(ours) == 1 and "cannot write the outputs to /proc/no-such-folder" in ours[0], result.stderr


def test_a_failed_run_fixed_and_rerun_into_the_same_output_draws_every_image(tmp_path):
    """A prompts run with a typo in --model, then one that fails after loading (a pipeline argument the family does
    not take), each left a run.json that refused the corrected command ("holds a run with other arguments"); the
    corrected command now draws every image, with no manual step. Each on 2 ranks given torchrun's environment
    (run_cli), each error said once."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a 3\na 5\n")
    output = tmp_path / "out"
    common = ["--prompts", str(prompts), "--output", str(output), "--steps", "3", "--no-progress"]

    typo = run_cli(["run", "--model", "digts", *common], 2)
    assert typo.codes == [2, 2] and len(_said(typo)) == 1 and "no pipeline folder at digts" in typo.stderr, typo
    assert json.loads((output / "run.json").read_text())["model"] == "digts"  # it did open the folder

    failed = run_cli(["run", "--model", "digits", "--cfg", "2", *common, "--option", "no_such_argument=1"], 2)
    assert failed.codes == [2, 2] and len(_said(failed)) == 1, failed
    assert "no_such_argument" in failed.stderr and "Traceback" not in failed.stderr, failed
    assert json.loads((output / "run.json").read_text())["call"]["no_such_argument"] == 1

    fixed = run_cli(["run", "--model", "digits", "--cfg", "2", *common], 2)
    assert fixed.codes == [0, 0], fixed
    assert "drew 2 of 2 images" in fixed.stdout, fixed
    assert sorted(p.name for p in output.glob("*.png")) == ["00000-0.png", "00001-0.png"]


def test_outputs_follow_the_umask_and_a_refused_folder_is_not_left_behind(tmp_path):
    """Images were written 0600 (mkstemp's mode), unreadable to the user's group; now as any file the user writes
    (0666 less the umask). Checking a missing --output leaves no empty folder behind: the first write makes it."""
    import os

    mask = os.umask(0o022)
    try:
        written = atomic_write(tmp_path / "a.png", lambda p: p.write_bytes(b"png"))
    finally:
        os.umask(mask)
    assert stat.S_IMODE(written.stat().st_mode) == 0o644
    check_output_folder(tmp_path / "new" / "deeper")
    assert not (tmp_path / "new").exists()
