"""`xdit-lab run` under torchrun, on one node and on two nodes over loopback; its atomic writes.

Command lines come from xdit_lab.lessons (run_argv, torchrun_argv, run_processes), the
helpers tutorial 10 teaches with, so the tests launch torchrun as a user following it would."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from xdit_lab import ParallelConfig
from xdit_lab.distributed import free_port
from xdit_lab.lessons import production
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
SEED = 7
KWARGS = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3, guidance_scale=3.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


def _ports(n):
    """n distinct free ports, for torchruns started together."""
    ports = set()
    while len(ports) < n:
        ports.add(free_port())
    return list(ports)


def _run(folder, output, config, *extra, **overrides):
    """`xdit-lab run` arguments for the tiny pipeline's call (KWARGS, overridden), plus `extra` flags."""
    return [
        "-m",
        "xdit_lab.cli",
        *production.run_argv(folder, PROMPTS, config, output, seed=SEED, **dict(KWARGS, **overrides)),
        *extra,
    ]


def _succeed(commands, timeout_s=240):
    """Run the commands together (production.run_processes); fail with the output of any that failed."""
    for result in production.run_processes(commands, timeout_s):
        assert result["returncode"] == 0 and not result["timed_out"], result["output"][-4000:]


def _images(output):
    return [np.asarray(Image.open(output / f"{i:03d}.png")) for i in range(len(PROMPTS))]


def _bytes_on_disk(folder, component) -> dict[str, int]:
    """Each tensor's bytes in a component's safetensors files, read with safetensors' own reader."""
    from safetensors import safe_open

    size = {"F32": 4, "F16": 2, "BF16": 2}
    sizes = {}
    for file in sorted((folder / component).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                sizes[key] = int(np.prod(tensor.get_shape())) * size[tensor.get_dtype()]
    return sizes


def test_torchrun_one_node_and_two_nodes_give_the_same_images(folder, tmp_path):
    one_node, two_nodes = tmp_path / "one", tmp_path / "two"
    single, shared = _ports(2)
    config = ParallelConfig(cfg=2)
    _succeed(
        [production.torchrun_argv(2, master_port=single) + _run(folder, one_node, config)]
        + [
            production.torchrun_argv(1, nnodes=2, node_rank=rank, master_port=shared) + _run(folder, two_nodes, config)
            for rank in range(2)
        ]
    )

    report = json.loads((one_node / "report.json").read_text())
    assert report["config_short"] == "cfg2" and report["outputs"] == ["000.png", "001.png"]
    assert len(report["timings"]["steps"]) == report["steps"] == 3
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    # each step, a cfg rank sends its branch's noise prediction: 2 prompts × the output's elements × 4 bytes
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    scale = 2 ** (len(json.loads((folder / "vae" / "config.json").read_text())["block_out_channels"]) - 1)
    prediction = transformer["out_channels"] * (KWARGS["height"] // scale) * (KWARGS["width"] // scale)
    for r in report["ranks"]:
        steps = [{g: n for g, n in step.items() if n} for step in r["bytes_out_by_phase"]["per_step"]]
        assert steps == [{"cfg": len(PROMPTS) * prediction * 4}] * 3, steps
    assert all(r["bytes_out_by_group"].get("cfg", 0) > 0 for r in report["ranks"])
    for r in report["ranks"]:  # the run's cfg bytes, told apart by phase: encode, each of 3 steps, decode
        phases = r["bytes_out_by_phase"]
        assert len(phases["per_step"]) == 3 and all(step["cfg"] > 0 for step in phases["per_step"])
        assert phases["encode"]["cfg"] > 0 and phases["decode"]["cfg"] > 0
        parts = phases["encode"]["cfg"] + sum(step["cfg"] for step in phases["per_step"]) + phases["decode"]["cfg"]
        assert parts == r["bytes_out_by_group"]["cfg"]
    whole = {c: sum(_bytes_on_disk(folder, c).values()) for c in ("transformer", "text_encoder", "vae")}
    assert all(r["memory"]["parameter_bytes"] == whole for r in report["ranks"])  # cfg: every rank holds all
    for a, b in zip(_images(one_node), _images(two_nodes)):
        assert np.array_equal(a, b)
    assert not list(one_node.glob("*.partial")) and not list(two_nodes.glob("*.partial"))


def test_run_failure_leaves_no_partial_file(folder, tmp_path):
    output = tmp_path / "out"
    command = production.torchrun_argv(1, master_port=free_port()) + _run(folder, output, ParallelConfig(), height=30)
    (result,) = production.run_processes([command], timeout_s=240)
    assert result["returncode"] != 0 and not result["timed_out"]
    assert "height 30 not a multiple of 4" in result["output"]
    assert not output.exists() or not any(output.iterdir())


def test_torchrun_latent_output_equals_serial_diffusers(folder, tmp_path):
    """`--output-type latent` writes latents.pt: under cfg 2, under PipeFusion 2 with every step
    a warmup step, compiled (`--compile`) under ulysses 2, and with sharded weights (`--shard-weights`)
    under ring 2, equal to diffusers' own pipeline run serially with output_type="latent" (1e-4
    relative). Each PipeFusion stage reports part of the transformer's parameters and sends patches;
    with sharded weights each rank reports half of the transformer and of the text encoder, and
    gathers them ("weights", "world")."""
    from diffusers import DiffusionPipeline

    configs = {
        "cfg": ParallelConfig(cfg=2),
        "pipefusion": ParallelConfig(pipefusion=2, warmup_steps=3),
        "compiled": ParallelConfig(ulysses=2),
        "sharded": ParallelConfig(ring=2),
    }
    flags = {"compiled": ["--compile"], "sharded": ["--shard-weights"]}
    _succeed(
        [
            production.torchrun_argv(2, master_port=port)
            + _run(
                folder,
                tmp_path / name,
                config,
                "--output-type",
                "latent",
                *flags.get(name, []),
            )
            for port, (name, config) in zip(_ports(len(configs)), configs.items())
        ],
        timeout_s=420,
    )

    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    with torch.no_grad():
        expected = reference(
            PROMPTS, generator=torch.Generator().manual_seed(SEED), output_type="latent", **KWARGS
        ).images
    for name in configs:
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["outputs"] == ["latents.pt"] and not list((tmp_path / name).glob("*.png"))
        latents = torch.load(tmp_path / name / "latents.pt")
        assert latents.shape == expected.shape
        assert (latents - expected).abs().max() <= 1e-4 * expected.abs().max(), name
    compiled = json.loads((tmp_path / "compiled" / "report.json").read_text())
    assert compiled["compiled"] is True and [r["compiled_graphs"] for r in compiled["ranks"]] == [1, 1]
    assert [r["compiled_graphs"] for r in json.loads((tmp_path / "cfg" / "report.json").read_text())["ranks"]] == [0, 0]
    whole = json.loads((tmp_path / "cfg" / "report.json").read_text())["ranks"][0]["memory"]["parameter_bytes"]
    staged = json.loads((tmp_path / "pipefusion" / "report.json").read_text())
    assert staged["config"]["pipefusion"] == 2
    # a stage holds its own block (the tiny transformer has 2) and everything outside the blocks
    on_disk = _bytes_on_disk(folder, "transformer")
    outside = sum(n for key, n in on_disk.items() if not key.startswith("transformer_blocks."))
    for r in staged["ranks"]:
        own = sum(n for key, n in on_disk.items() if key.startswith(f"transformer_blocks.{r['rank']}."))
        assert r["memory"]["parameter_bytes"]["transformer"] == outside + own, r["memory"]["parameter_bytes"]
    sharded = json.loads((tmp_path / "sharded" / "report.json").read_text())
    assert sharded["shard_weights"] is True
    for r in sharded["ranks"]:
        held = r["memory"]["parameter_bytes"]
        assert 0.4 < held["transformer"] / whole["transformer"] <= 0.6, held
        assert 0.4 < held["text_encoder"] / whole["text_encoder"] <= 0.6, held
        assert r["bytes_out_by_group"]["weights"] > 0 and r["bytes_out_by_group"]["world"] > 0
    assert all(r["bytes_out_by_group"].get("pipefusion", 0) > 0 for r in staged["ranks"])


def test_atomic_write_fault_mid_write_leaves_no_partial_file(tmp_path):
    """A fault in the middle of a write (the writer has put part of the file down, then raises):
    no temporary file stays behind, a new target never appears, and an existing one keeps its
    content. An interrupt (a BaseException) cleans up the same way; a write that succeeds replaces."""
    from xdit_lab.run import atomic_write

    def half_then_fault(path):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
        assert path.stat().st_size == 4096  # the partial file is on disk when the fault hits
        raise OSError("No space left on device (injected)")

    def half_then_interrupt(path):
        path.write_bytes(b"y" * 10)
        raise KeyboardInterrupt

    existing = tmp_path / "report.json"
    existing.write_text('{"old": true}')
    for target in (existing, tmp_path / "000.png"):
        with pytest.raises(OSError, match="injected"):
            atomic_write(target, half_then_fault)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(tmp_path / "latents.pt", half_then_interrupt)
    assert existing.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    atomic_write(existing, lambda path: path.write_text('{"new": true}'))
    assert existing.read_text() == '{"new": true}' and sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
