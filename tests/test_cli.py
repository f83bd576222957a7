"""xdit-lab plan: the table it prints is options()'s ranking; bad input exits 2 without a traceback."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xdit_lab import ParallelConfig
from xdit_lab.cli import main
from xdit_lab.distributed import usable_cpu_cores


def _run(*args: str, script: bool = False, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the CLI as a user would: the installed console script, or `python -m xdit_lab.cli`."""
    command = [str(Path(sys.executable).with_name("xdit-lab"))] if script else [sys.executable, "-m", "xdit_lab.cli"]
    env = {**os.environ, **env} if env else None
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=120, env=env)


def _imported_packages(stderr: str) -> set[str]:
    """The top-level packages a process imported, from Python's own list (PYTHONPROFILEIMPORTTIME=1 on stderr)."""
    rows = [line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")]
    return {name.split(".")[0] for name in rows[1:]}  # the first row is the column titles


def _table(stdout: str) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the printed table (rows start with their rank number; the legend follows them)."""
    lines = stdout.splitlines()
    lines = lines[: lines.index("Columns:")] if "Columns:" in lines else lines
    header = next(line for line in lines if line.lstrip().startswith("#"))
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    return header.split(), rows


def test_plan_rows_match_options():
    """The table is options()'s ranking. It is arithmetic: the process never imports diffusers, transformers or
    the rest of what loading a pipeline needs (xdit_lab/__init__.py's promise that `xdit-lab plan` starts in a
    moment; importing fit/ for --gpu-memory's parser once made every `plan` wait for diffusers)."""
    result = _run("plan", "--world-size", "4", "--heads", "4", "--top", "0", env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stderr
    imported = _imported_packages(result.stderr)
    assert {"torch", "xdit_lab"} <= imported, sorted(imported)  # the list is read: the control
    assert not imported & {"diffusers", "transformers", "accelerate", "peft", "scipy"}, sorted(imported)
    assert result.stdout.startswith("Parallel configurations for 4 ranks (--world-size); heads 4,")
    header, rows = _table(result.stdout)
    assert header[:9] == ["#", "config", "dp", "cfg", "pf", "ring", "ulysses", "tp", "work"]
    # tp ranked beside the others (a family with a tp plan; --no-tp: one without), at the degrees that divide the heads
    expected = ParallelConfig.options(4, num_heads=4, tensor_parallel=True)
    assert {"tp4", "cfg2·tp2", "ulysses2·tp2"} <= {c.short() for c in expected}
    assert [row[1] for row in rows] == [c.short() for c in expected]
    assert [int(row[0]) for row in rows] == list(range(1, len(expected) + 1))
    for row, c in zip(rows, expected):
        assert [int(x) for x in row[2:8]] == [c.dp, c.cfg, c.pipefusion, c.ring, c.ulysses, c.tp]
        cost = c.cost(None)
        assert float(row[8]) == pytest.approx(cost.work_fraction, rel=1e-2)
        assert float(row[9]) == pytest.approx(cost.comm_p_hs, rel=1e-2)
        assert row[10] == ("1" if c.pipefusion * c.tp == 1 else f"1/{c.pipefusion * c.tp}")
    assert "p·hs" in result.stdout and "ParallelConfig" in result.stdout.splitlines()[-1]


@pytest.mark.skipif(not Path(sys.executable).with_name("xdit-lab").exists(), reason="package not installed")
def test_console_script_is_installed():
    result = _run("plan", "--world-size", "2", "--no-cfg", script=True)
    assert result.returncode == 0, result.stderr
    assert [row[1] for row in _table(result.stdout)[1]] == [
        c.short() for c in ParallelConfig.options(2, use_cfg=False, tensor_parallel=True)
    ]


def test_bad_world_size_exits_2_without_traceback():
    result = _run("plan", "--world-size", "0")
    assert result.returncode == 2 and result.stdout == ""
    assert "argument --world-size: must be at least 1, got 0" in result.stderr
    assert "Traceback" not in result.stderr


def test_run_refuses_a_degree_before_reading_the_folder_or_importing_diffusers(tmp_path):
    """`xdit-lab run --cfg 3` outside torchrun (a world of 1): exit 2 with the mesh's reasons (cfg 3 is no
    branch count; 3 ranks are not 1), before the folder is looked at (it does not exist) and before diffusers
    is imported (it once came after the imports and the folder's index: 13 s here, now under 3). Control: a
    degree that fits goes on to the folder, and says it is missing."""
    missing = tmp_path / "no-such-model"
    common = ["run", "--model", str(missing), "--prompt", "a red cat", "--output", str(tmp_path / "out")]
    env = {"PYTHONPROFILEIMPORTTIME": "1", "WORLD_SIZE": "1", "RANK": "0"}
    refused, control = _run(*common, "--cfg", "3", env=env), _run(*common, env=env)
    lines = [line for line in refused.stderr.splitlines() if not line.startswith("import time:")]
    assert refused.returncode == 2 and lines[0] == "xdit-lab run: error: cannot build a RankMesh:", refused.stderr
    assert "cfg must be 1 or 2" in lines[1] and "multiply to cfg 3 = 3 ranks, but the world size is 1" in lines[2]
    assert "Traceback" not in refused.stderr and str(missing) not in refused.stderr
    imported = _imported_packages(refused.stderr)
    assert "torch" in imported and not imported & {"diffusers", "transformers"}, sorted(imported)
    assert control.returncode == 2, control.stderr[-2000:]
    assert f"xdit-lab run: error: no pipeline folder at {missing}" in control.stderr, control.stderr[-2000:]
    assert "RankMesh" not in control.stderr
    garbled = _run(*common, env={"WORLD_SIZE": "two", "RANK": "0"})  # a launcher's environment, mistyped
    assert garbled.returncode == 2 and "Traceback" not in garbled.stderr, garbled.stderr[-2000:]
    assert garbled.stderr == "xdit-lab run: error: environment variable WORLD_SIZE='two' is not an integer\n"


@pytest.mark.parametrize(
    "args, message",
    [
        (["plan", "--heads", "four"], "argument --heads: expected a whole number, got 'four'"),
        (["plan", "--top", "-1"], "argument --top: must be at least 0, got -1"),
        (["plan", "--batch", "0"], "argument --batch: must be at least 1, got 0"),
        (["plan", "--frobnicate"], "unrecognized arguments: --frobnicate"),
        ([], "the following arguments are required: COMMAND"),
    ],
)
def test_bad_input_exits_2_with_a_message(args, message, capsys):
    with pytest.raises(SystemExit) as exited:  # in-process: argparse's own exit, as the script would see it
        main(args)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_bytes_column_top_no_cfg_and_no_tp(capsys):
    assert (
        main(
            [
                "plan",
                "--world-size",
                "8",
                "--heads",
                "24",
                "--seq-len",
                "4096",
                "--hidden-size",
                "1152",
                "--no-cfg",
                "--no-tp",
                "--top",
                "3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    header, rows = _table(out)
    assert "bytes" in header and len(rows) == 3
    options = ParallelConfig.options(8, num_heads=24, seq_len=4096, use_cfg=False)
    assert f"... {len(options) - 3} more (--top 0 shows all {len(options)})" in out
    best = options[0].cost(None, use_cfg=False).comm_bytes(4096, 1152)
    assert f"{best / 1e6:.1f} MB" in " ".join(rows[0])
    assert all(row[3] == "1" for row in rows)  # the cfg column: --no-cfg leaves out cfg 2
    assert all(row[7] == "1" for row in rows) and "tp off (--no-tp)" in out  # --no-tp: a family without a tp plan


def _legend_names(stdout: str) -> list[str]:
    """The column names the legend under the table explains, in its order (an entry starts two spaces in)."""
    lines = stdout.splitlines()
    start = lines.index("Columns:")
    names = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        if line[2] != " ":
            names.append(re.split(r"\s{2,}", line.strip())[0])
    return names


@pytest.mark.parametrize(
    "args",
    [
        ["--world-size", "4", "--heads", "4"],  # the README's
        ["--world-size", "8", "--heads", "24", "--seq-len", "4096", "--hidden-size", "3072", "--top", "0", "--why"],
    ],
)
def test_plan_keeps_to_100_columns_and_its_legend_names_each_column(capsys, args):
    """Every line within 100 columns: the heading, the table, the legend (a 372-character 'Units:' line until
    now) and --why's reasons (a 70-character column until now), each said under the table as config.ranking_reasons
    says it. The legend names each column of the table, in its order; bytes in decimal units."""
    from xdit_lab.config import ranking_reasons

    assert main(["plan", *args]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100, max(out.splitlines(), key=len)
    header_line = next(line for line in out.splitlines() if line.lstrip().startswith("# "))
    columns = re.split(r"\s{2,}", header_line.strip())
    assert columns[:9] == ["#", "config", "dp", "cfg", "pf", "ring", "ulysses", "tp", "work"]
    assert _legend_names(out) == columns
    assert "GiB" not in out and "MiB" not in out
    if "--why" in args:
        assert "comm bytes" in columns and " MB" in out
        options = ParallelConfig.options(8, num_heads=24, seq_len=4096, tensor_parallel=True)
        said = re.findall(r"^  #(\d+) (\S+): (.*(?:\n      .*)*)", out, flags=re.M)
        expected = ranking_reasons(options)
        assert [(int(i), name) for i, name, _ in said] == [(i, c.short()) for i, c in enumerate(options[:-1], 1)]
        assert [" ".join(reason.split()) for *_, reason in said] == expected[:-1]


def test_default_world_size_is_the_local_machine(capsys):
    import torch

    assert main(["plan"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    if torch.cuda.is_available() and torch.cuda.device_count():
        assert f"for {torch.cuda.device_count()} ranks (this machine: " in first and "CUDA GPU" in first
    else:
        cores = usable_cpu_cores()
        assert first.startswith(
            f"Parallel configurations for {cores} ranks (this machine: no CUDA GPU visible, so {cores} CPU core"
        )
        assert cores <= (os.cpu_count() or cores)


def test_no_tp_is_refused_with_a_model_folder_whose_family_decides(capsys, tmp_path):
    """--model ranks tp where the folder's family has a tp plan; --no-tp beside it is one line and exit 2, said
    before the folder (which does not exist here) is read. Control: without it, the missing folder is what is said."""
    common = ["plan", "--model", str(tmp_path / "absent"), "--world-size", "2", "--gpu-memory", "24GB"]
    assert main([*common, "--no-tp"]) == 2
    said = capsys.readouterr().err
    assert "--no-tp is for plan without --model" in said and "absent" not in said
    assert main(common) == 2 and "absent" in capsys.readouterr().err
