"""`xdit-lab run --prompts FILE`: a prompts file read line by line into images with their own ids and seeds
(prompts_file.py), drawn in batches over dp, each image written and recorded as it is made, and resumed after a
kill (output_folder.py). The reference is a serial run of the same file, one image per call."""

import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import torch

from xdit_lab.lessons import production
from xdit_lab.output_folder import RECORDS_FILE, OutputFolderError, append_record, open_run
from xdit_lab.prompts_file import PromptsFileError, image_seed, read_prompts_file
from xdit_lab.testing import run_cli

# ---- the file, read in-process ------------------------------------------------------------------------------


def test_text_and_json_lines_give_ids_and_seeds_per_image(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("a red cat\n\n  a blue dog  \n")
    jobs = read_prompts_file(text, images_per_prompt=2, seed=5)
    assert [(j.id, j.prompt, j.line) for j in jobs] == [
        ("00000-0", "a red cat", 1),
        ("00000-1", "a red cat", 1),
        ("00001-0", "a blue dog", 3),
        ("00001-1", "a blue dog", 3),
    ]
    seeds = [j.seed for j in jobs]
    assert len(set(seeds)) == 4  # no two images share noise
    assert seeds == [j.seed for j in read_prompts_file(text, images_per_prompt=2, seed=5)]  # and a rerun draws it again
    assert seeds != [j.seed for j in read_prompts_file(text, images_per_prompt=2, seed=6)]  # --seed changes them
    # an image's seed depends on its prompt's place, not on the prompts after it
    (tmp_path / "longer.txt").write_text("a red cat\na blue dog\na green bird\n")
    assert [j.seed for j in read_prompts_file(tmp_path / "longer.txt", 2, seed=5)][:4] == seeds

    lines = tmp_path / "prompts.jsonl"
    lines.write_text(
        '{"prompt": "a red cat", "id": "cat", "seed": 11}\n{"prompt": "a blue dog", "negative_prompt": "blurry"}\n'
    )
    cat0, cat1, dog0 = read_prompts_file(lines, images_per_prompt=2)[:3]
    assert (cat0.id, cat0.seed, cat1.id, cat1.seed) == ("cat-0", 11, "cat-1", 12)
    assert (dog0.id, dog0.negative_prompt, dog0.seed) == ("00001-0", "blurry", image_seed(0, 1, 0))


@pytest.mark.parametrize(
    "name, content, said",
    [
        ("empty.txt", "\n  \n", "holds no prompt: give one prompt per line"),
        ("bad.jsonl", '{"prompt": "a cat"}\n{"prompt": "a dog",\n', ":2: not JSON"),
        ("no_prompt.jsonl", '{"text": "a cat"}\n', ':1: expected an object with a non-empty text "prompt"'),
        ("field.jsonl", '{"prompt": "a cat", "sede": 3}\n', ":1: unknown field sede"),
        ("seed.jsonl", '{"prompt": "a cat", "seed": "3"}\n', ":1: seed must be a whole number >= 0, got '3'"),
        ("id.jsonl", '{"prompt": "a cat", "id": "../cat"}\n', ":1: id '../cat' cannot name a file"),
        (
            "twice.jsonl",
            '{"prompt": "a", "id": "x"}\n{"prompt": "b", "id": "x"}\n',
            ":2: id 'x' is also the id of line 1",
        ),
    ],
)
def test_a_bad_prompts_file_is_refused_naming_the_line(tmp_path, name, content, said):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(PromptsFileError) as refused:
        read_prompts_file(path)
    assert str(refused.value).startswith(str(path)) and said in str(refused.value), refused.value


# ---- the output folder, in-process ----------------------------------------------------------------------------


def test_a_rerun_keeps_complete_records_drops_the_rest_and_refuses_other_arguments(tmp_path):
    identity = dict(model="digits", steps=4, config={"ulysses": 1})
    assert open_run(tmp_path, identity) == {}
    for name in ("a-0", "a-1", "b-0"):
        (tmp_path / f"{name}.png").write_bytes(b"image")
        append_record(tmp_path, dict(id=name, file=f"{name}.png"))
    (tmp_path / "b-0.png").unlink()  # its record outlived its file: drawn again
    with open(tmp_path / RECORDS_FILE, "a") as records:
        records.write('{"id": "b-1", "fi')  # a line torn by a kill
    (tmp_path / ".a-2.png.x1.partial").write_bytes(b"half")  # a temporary a killed write left

    done = open_run(tmp_path, identity)
    assert sorted(done) == ["a-0", "a-1"]
    assert [json.loads(line)["id"] for line in (tmp_path / RECORDS_FILE).read_text().splitlines()] == ["a-0", "a-1"]
    assert not list(tmp_path.glob(".*.partial"))

    with pytest.raises(
        OutputFolderError, match=r"holds 2 image\(s\) of a run with other arguments \(steps: 4 there, 8 now"
    ):
        open_run(tmp_path, dict(identity, steps=8))
    with pytest.raises(OutputFolderError, match=r"\(config.ulysses: 1 there, 3 now\)"):  # the leaf, not two dicts
        open_run(tmp_path, dict(identity, config={"ulysses": 3}))
    assert sorted(open_run(tmp_path, identity)) == ["a-0", "a-1"]  # the refusals changed nothing

    drew_nothing = tmp_path / "failed-first"  # a run that failed before its first image binds no rerun
    open_run(drew_nothing, identity)
    assert open_run(drew_nothing, dict(identity, steps=8)) == {}
    assert json.loads((drew_nothing / "run.json").read_text())["steps"] == 8
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "000.png").write_bytes(b"image")
    with pytest.raises(OutputFolderError, match="holds outputs but no run.json"):
        open_run(stray, identity)


def test_a_full_disk_mid_record_leaves_whole_lines_and_an_unwritable_folder_is_refused(tmp_path, monkeypatch):
    """The disk fills while a record is written: half the line reaches the file, then ENOSPC. append_record cuts
    the half line off and raises, so records.jsonl keeps whole lines and a rerun resumes from them. A --output that
    is a file is refused before anything else."""
    import errno
    import os

    import xdit_lab.output_folder as output_folder

    open_run(tmp_path, {"model": "digits"})
    append_record(tmp_path, dict(id="a-0", file="a-0.png"))
    real_write = os.write

    def half_then_full(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output_folder.os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left on device"):
        append_record(tmp_path, dict(id="a-1", file="a-1.png"))
    monkeypatch.undo()
    assert (tmp_path / RECORDS_FILE).read_text() == json.dumps(dict(id="a-0", file="a-0.png")) + "\n"

    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    with pytest.raises(OutputFolderError, match=f"--output {a_file} is a file"):
        open_run(a_file, {"model": "digits"})


# ---- torchrun ------------------------------------------------------------------------------------------------

STEPS = 3


def _run_argv(prompts, output, *extra):
    return [
        "-m",
        "xdit_lab.cli",
        "run",
        "--model",
        "digits",
        "--prompts",
        str(prompts),
        "--steps",
        str(STEPS),
        "--seed",
        "3",
        "--output-type",
        "latent",
        "--output",
        str(output),
        "--no-progress",
        *extra,
    ]


def _latents(folder) -> dict[str, torch.Tensor]:
    return {path.stem: torch.load(path) for path in folder.glob("*.pt")}


KILLED_RUN_PROMPTS = 32  # eight batches of 4 under dp 2: the kill after the first leaves at least six to resume


def _workers(proc) -> dict[str, psutil.Process]:
    """torchrun's workers, by LOCAL_RANK (those started so far)."""
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if "xdit_lab.cli" in child.cmdline():
                found[child.environ().get("LOCAL_RANK")] = child
        except psutil.NoSuchProcess:  # one that ended meanwhile
            continue
    return found


@pytest.mark.timeout(720)
def test_a_killed_dp2_run_resumes_to_the_serial_run_image_for_image(tmp_path):
    """32 digits prompts under dp 2 in batches of 4; rank 1 is killed (SIGKILL) once the first batch is recorded;
    the same command again draws only the rest. Every image then equals the serial run's, drawn one per call,
    within 1e-4, and records.jsonl holds each image once. (With rank 1 gone, rank 0 writes at most the batch it
    has gathered. The kill must come before the last batch, 7 batches after the first: about 1 s of drawing on an
    idle 2-core machine, longer on a busy one; the workers are found before the first image, so that the kill is
    one signal away when it comes.)"""
    n = KILLED_RUN_PROMPTS
    prompts = tmp_path / "digits.txt"
    prompts.write_text("".join(f"a handwritten {i % 10}\n" for i in range(n)))
    serial, parallel = tmp_path / "serial", tmp_path / "dp2"
    dp2 = production.torchrun_argv(2) + _run_argv(prompts, parallel, "--dp", "2", "--batch-size", "4")

    killed_at = None
    proc = subprocess.Popen(dp2, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        workers = {}
        records = parallel / RECORDS_FILE
        while killed_at is None and proc.poll() is None and time.monotonic() < deadline:
            if "1" not in workers:
                workers = _workers(proc)
            elif records.exists() and len(records.read_text().splitlines()) >= 4:
                workers["1"].send_signal(signal.SIGKILL)
                killed_at = len(records.read_text().splitlines())
            time.sleep(0.01)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert killed_at is not None and proc.returncode != 0, output[-3000:]
    interrupted = len(_latents(parallel))
    assert 4 <= interrupted < n, interrupted  # killed mid-run, after the first batch
    assert len((parallel / RECORDS_FILE).read_text().splitlines()) < n

    # the resume under torchrun, as the user reruns it; the serial reference beside it, on one rank given
    # torchrun's environment (run_cli: no torchrun and fresh interpreter for a reference)
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(run_cli, _run_argv(prompts, serial, "--batch-size", "1")[2:], 1, timeout_s=480)
        (resumed,) = production.run_processes(
            [production.torchrun_argv(2) + _run_argv(prompts, parallel, "--dp", "2", "--batch-size", "4")],
            timeout_s=480,
        )
        reference = reference.result()
    assert resumed["returncode"] == 0 and not resumed["timed_out"], resumed["output"][-4000:]
    assert reference.codes == [0], reference

    report = json.loads((parallel / "report.json").read_text())
    # only the missing images drawn (one written but not yet recorded at the kill is drawn again)
    assert report["resumed_with"] >= interrupted - 1 and report["resumed_with"] + report["drawn"] == n, report
    assert report["drawn"] > 0, report
    records = [json.loads(line) for line in (parallel / RECORDS_FILE).read_text().splitlines()]
    assert sorted(r["id"] for r in records) == sorted(f"{i:05d}-0" for i in range(n))  # each once
    assert not [p.name for p in parallel.iterdir() if p.name.startswith(".")]  # no temporary left
    drawn, expected = _latents(parallel), _latents(serial)
    assert sorted(drawn) == sorted(expected) and len(drawn) == n
    worst = max(((drawn[i] - expected[i]).abs().max() / expected[i].abs().max()).item() for i in expected)
    assert worst < 1e-4, worst
    # the control: neighbours differ (each image has noise of its own), so the comparison can fail
    assert ((drawn["00000-0"] - expected["00010-0"]).abs().max() / expected["00010-0"].abs().max()).item() > 1e-2

    # xdit-lab compare, as a user runs it on the two folders: every image matched, none differing beyond 1e-4
    compared = subprocess.run(
        [sys.executable, "-m", "xdit_lab.cli", "compare", str(serial), str(parallel)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert compared.returncode == 0, compared.stderr[-3000:]
    summary = json.loads((parallel / "compare" / "compare.json").read_text())["summary"]
    largest = max(t.abs().max().item() for t in expected.values())
    assert summary["images"] == n and not summary["only_in_a"] and not summary["only_in_b"], summary
    assert summary["largest_difference"] < 1e-4 * largest, summary


def test_a_long_prompt_and_a_failed_write_name_their_line_and_image_then_a_rerun_resumes(tmp_path):
    """In a plain process (a world of one, run_cli's): a prompt longer than the digits' text encoder reads is
    refused before anything is drawn, naming its line; image 00002-0's name is taken by a folder, so its write
    fails: exit 1 naming it, the two images before it written and recorded; with the folder gone, the same command
    draws the rest."""
    long = tmp_path / "long.txt"
    long.write_text("a handwritten 1\na handwritten 2 " + "very " * 20 + "\n")
    prompts = tmp_path / "digits.txt"
    prompts.write_text("".join(f"a handwritten {i}\n" for i in range(5)))
    blocked = tmp_path / "blocked"
    (blocked / "00002-0.png").mkdir(parents=True)  # a name taken: the write of image 00002-0 fails

    def run(file, folder, *, bar=False):
        argv = _run_argv(file, folder, "--batch-size", "2")[2:]  # without "-m xdit_lab.cli"
        argv = argv[: argv.index("--output-type")] + argv[argv.index("--output-type") + 2 :]
        argv = [arg for arg in argv if arg != "--no-progress"] if bar else argv
        env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        return run_cli(argv, torchrun=False, env=env, timeout_s=240)

    refused = run(long, tmp_path / "never")
    errors = [line for line in refused.stderr.splitlines() if line.startswith("xdit-lab run: error:")]
    assert refused.codes == [2] and len(errors) == 1, refused
    assert errors[0].startswith(f"xdit-lab run: error: {long}:2: the prompt is 24 tokens"), errors[0]
    assert not (tmp_path / "never" / RECORDS_FILE).exists()

    failed = run(prompts, blocked)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("xdit-lab run: error:")]
    assert failed.codes == [1] and len(errors) == 1 and "Traceback" not in failed.output, failed
    assert errors[0].startswith(f"xdit-lab run: error: writing image 00002-0 (line 3) to {blocked}/00002-0.png"), errors
    assert "2 image(s) are written and recorded in records.jsonl" in errors[0], errors[0]
    recorded = [json.loads(line)["id"] for line in (blocked / RECORDS_FILE).read_text().splitlines()]
    assert recorded == ["00000-0", "00001-0"]

    (blocked / "00002-0.png").rmdir()
    rerun = run(prompts, blocked, bar=True)
    assert rerun.codes == [0], rerun
    report = json.loads((blocked / "report.json").read_text())
    assert (report["resumed_with"], report["drawn"]) == (2, 3), report
    assert report["images_per_second"] > 0 and sorted(report["seconds_per_phase"]) == ["decode", "denoise", "encode"]
    assert all(report["seconds_per_phase"][phase] > 0 for phase in ("encode", "denoise")), report
    # rank 0's bar: images done of all (from the 2 found done), the rate (seconds an image where under 1/s: a busy
    # machine), the time left
    bar = rerun.stderr.replace("\r", "\n").splitlines()
    rate = r"5/5 \[\d\d:\d\d<00:00, +[\d.]+(image/s|s/image)\]"
    assert any(re.search(rate, line) for line in bar), rerun.stderr[-2000:]
    assert any(re.search(r"2/5 \[", line) for line in bar), rerun.stderr[-2000:]
    recorded = [json.loads(line)["id"] for line in (blocked / RECORDS_FILE).read_text().splitlines()]
    assert recorded == [f"{i:05d}-0" for i in range(5)]
    assert sorted(p.name for p in blocked.glob("*.png")) == [f"{i:05d}-0.png" for i in range(5)]
