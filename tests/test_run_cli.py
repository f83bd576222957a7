"""`xdit-lab run` under torchrun, on one node and on two nodes over loopback."""

import json
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from xdit_lab.distributed import free_port
from xdit_lab.tiny import save_tiny_pipeline

PROMPTS = ["a red cat", "a blue dog"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


def _run_args(folder, output, *extra):
    args = ["run", "--model", str(folder), "--output", str(output), "--steps", "3", "--seed", "7",
            "--height", "16", "--width", "16", "--guidance", "3.0", "--no-progress",
            "--option", "use_resolution_binning=false", "--option", "clean_caption=false",
            "--option", "max_sequence_length=8", *extra]
    for prompt in PROMPTS:
        args += ["--prompt", prompt]
    return args


def _torchrun(*launcher_args, timeout=240):
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=240):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


def _images(output):
    return [np.asarray(Image.open(output / f"{i:03d}.png")) for i in range(len(PROMPTS))]


def test_torchrun_one_node_and_two_nodes_give_the_same_images(folder, tmp_path):
    one_node, two_nodes = tmp_path / "one", tmp_path / "two"
    _finish(_torchrun("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "xdit_lab.cli",
                      *_run_args(folder, one_node, "--cfg", "2")))
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [_torchrun("--nnodes", "2", "--node_rank", str(rank), "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", endpoint, "-m", "xdit_lab.cli", *_run_args(folder, two_nodes, "--cfg", "2"))
             for rank in range(2)]
    for node in nodes:
        _finish(node)

    report = json.loads((one_node / "report.json").read_text())
    assert report["config_short"] == "cfg2" and report["outputs"] == ["000.png", "001.png"]
    assert len(report["timings"]["steps"]) == 3 and report["timings"]["decode"] > 0
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert all(r["bytes_out_by_group"].get("cfg", 0) > 0 for r in report["ranks"])
    assert all(r["memory"]["parameter_total"] > 0 for r in report["ranks"])
    for a, b in zip(_images(one_node), _images(two_nodes)):
        assert np.array_equal(a, b)
    assert not list(one_node.glob("*.partial")) and not list(two_nodes.glob("*.partial"))


def test_run_failure_leaves_no_partial_file(folder, tmp_path):
    output = tmp_path / "out"
    proc = _torchrun("--nproc_per_node", "1", "--master_port", str(free_port()), "-m", "xdit_lab.cli",
                     *_run_args(folder, output, "--height", "30"))
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode != 0
    assert "height 30 not a multiple of 4" in out
    assert not output.exists() or not any(output.iterdir())


def test_torchrun_pipefusion_matches_cfg_parallel(folder, tmp_path):
    """PipeFusion through the CLI, every step a warmup step: the images of cfg 2 (up to rounding),
    and each stage reports half of the transformer's parameters."""
    reference, staged = tmp_path / "cfg", tmp_path / "pipefusion"
    _finish(_torchrun("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "xdit_lab.cli",
                      *_run_args(folder, reference, "--cfg", "2")))
    _finish(_torchrun("--nproc_per_node", "2", "--master_port", str(free_port()), "-m", "xdit_lab.cli",
                      *_run_args(folder, staged, "--pipefusion", "2", "--warmup-steps", "3")))
    for a, b in zip(_images(reference), _images(staged)):
        assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    full = json.loads((reference / "report.json").read_text())["ranks"][0]["memory"]["parameter_bytes"]["transformer"]
    report = json.loads((staged / "report.json").read_text())
    assert report["config"]["pipefusion"] == 2
    assert all(r["memory"]["parameter_bytes"]["transformer"] < full for r in report["ranks"])
    assert all(r["bytes_out_by_group"].get("pipefusion", 0) > 0 for r in report["ranks"])
