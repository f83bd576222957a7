"""`xdit-lab run` under torchrun, on one node and on two hosts; its atomic writes; what can go wrong in a run (the
output folder, a write, a hung peer), each a one-line error; its flags: latents, compile, sharded weights, float16,
bfloat16, GIFs, image to image and inpainting.

Command lines come from xdit_lab.lessons (run_argv, torchrun_argv, run_processes), the helpers tutorial 10 teaches
with, so the tests that need torchrun itself (its rendezvous on one node and across two hosts, a rank hung under
it) launch it as a user following it would. The tests of a flag run the console script's entry point on ranks given
torchrun's environment (xdit_lab.testing.run_cli): the same code in each rank, without a torchrun and a fresh
interpreter per rank."""

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from xdit_lab import ParallelConfig
from xdit_lab.lessons import production
from xdit_lab.testing import run_cli
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
SEED = 7
KWARGS = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3, guidance_scale=3.0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


def _argv(folder, output, config, *extra, **overrides):
    """`xdit-lab run` arguments for the tiny pipeline's call (KWARGS, overridden), plus `extra` flags."""
    return [*production.run_argv(folder, PROMPTS, config, output, seed=SEED, **dict(KWARGS, **overrides)), *extra]


def _run(folder, output, config, *extra, **overrides):
    """What torchrun runs: `-m xdit_lab.cli` and _argv."""
    return ["-m", "xdit_lab.cli", *_argv(folder, output, config, *extra, **overrides)]


def _cli(argv, ranks, timeout_s=240):
    """`xdit-lab ARGV` on `ranks` ranks given torchrun's environment (run_cli); fails with the job's output unless
    every rank exits 0."""
    job = run_cli(argv, ranks, timeout_s=timeout_s)
    assert job.codes == [0] * ranks, job
    return job


def _succeed(commands, timeout_s=240):
    """Run the commands together (production.run_processes); fail with the output of any that failed."""
    for result in production.run_processes(commands, timeout_s):
        assert result["returncode"] == 0 and not result["timed_out"], result["output"][-4000:]


def _images(output):
    return [np.asarray(Image.open(output / f"{i:03d}.png")) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def one_node(folder, tmp_path_factory):
    """The reference of the two tests below (its report; the two hosts' images and bytes): `xdit-lab run` under
    cfg 2, torchrun on one node, 2 ranks (run once)."""
    output = tmp_path_factory.mktemp("one_node")
    _succeed([production.torchrun_argv(2) + _run(folder, output, ParallelConfig(cfg=2))])
    return output


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


def test_torchrun_one_node_reports_cfg_bytes_by_phase_and_the_weights_each_rank_holds(folder, one_node):
    """The one-node reference's report: cfg 2 moves each step's noise prediction (the closed form), counted apart
    by phase (encode, each step, decode) and summing to the group's total; every rank holds every weight. (Two
    nodes give its images and bytes: the two-host test below; the same two nodes over loopback, which it replaced,
    proved nothing more.)"""
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
    assert np.asarray(_images(one_node)[0]).std() > 0 and not list(one_node.glob("*.partial"))


def test_torchrun_across_two_hosts_gives_the_one_node_images(folder, one_node, tmp_path):
    """`torchrun --nnodes 2` on two hosts (network namespaces with host names of their own, joined by a veth pair:
    tests/two_hosts.py) gives the same images as one node, each rank on its host, its collectives bound to the
    interface its route to the master leaves by (GLOO_SOCKET_IFNAME, chosen by init_distributed), and cfg 2 across
    the hosts moves the same bytes as on one node. Both rendezvous the README shows:
    - static, host A's address as the master (`--node_rank`, `--master_addr`), on hosts whose names resolve to
      nothing: gloo would bind loopback there and B would dial 127.0.0.1, but for the interface chosen;
    - c10d (`--rdzv-endpoint host-a:29400`, the same command on every host; torch ranks the nodes by their names),
      on hosts whose names resolve (torch's rendezvous looks its own host name up; the rank-0 node's name becomes
      the master address)."""
    from two_hosts import two_hosts

    config = ParallelConfig(cfg=2)
    alone = json.loads((one_node / "report.json").read_text())["ranks"]
    assert {r["interface"] for r in alone} == {None}  # one host: the route to the master is loopback
    launchers = {
        "static": lambda hosts, i: production.torchrun_argv(
            1, nnodes=2, node_rank=i, master_addr=hosts[0].address, master_port=29500
        ),  # in fresh namespaces nothing listens yet
        "c10d": lambda hosts, i: production.torchrun_argv(1, nnodes=2, rdzv_endpoint=f"{hosts[0].name}:29400"),
    }
    for rendezvous, launcher in launchers.items():
        two = tmp_path / rendezvous
        with two_hosts(names_resolve=rendezvous == "c10d") as hosts:
            _succeed([host.argv(launcher(hosts, i) + _run(folder, two, config)) for i, host in enumerate(hosts)])
        for a, b in zip(_images(one_node), _images(two), strict=True):
            assert np.array_equal(a, b), rendezvous
        ranks = json.loads((two / "report.json").read_text())["ranks"]
        assert [(r["host"], r["interface"]) for r in ranks] == [(h.name, h.interface) for h in hosts], ranks
        assert [r["bytes_out_by_group"] for r in ranks] == [r["bytes_out_by_group"] for r in alone], rendezvous


def test_run_failure_leaves_no_partial_file(folder, tmp_path):
    """A height the model refuses, on one rank given torchrun's environment: exit 2 saying why, nothing written."""
    output = tmp_path / "out"
    job = run_cli(_argv(folder, output, ParallelConfig(), height=30), 1)
    assert job.codes == [2] and "height 30 not a multiple of 4" in job.stderr, job
    assert not output.exists() or not any(output.iterdir())


def test_latent_output_compile_and_sharded_weights_equal_serial_diffusers(folder, tmp_path):
    """`--output-type latent` writes latents.pt: under PipeFusion 2 with every step a warmup step, compiled
    (`--compile`) under ulysses 2, and with sharded weights (`--shard-weights`) under ring 2, each on 2 ranks given
    torchrun's environment (run_cli), equal to diffusers' own pipeline run serially with output_type="latent" (1e-4
    relative). Each PipeFusion stage reports part of the transformer's parameters and sends patches; with sharded
    weights each rank reports half of the transformer and of the text encoder, and gathers them ("weights",
    "world"). (cfg 2 under torchrun: the one-node reference and the two-host test; the bfloat16 one below.)"""
    from diffusers import DiffusionPipeline

    configs = {
        "pipefusion": ParallelConfig(pipefusion=2, warmup_steps=3),
        "compiled": ParallelConfig(ulysses=2),
        "sharded": ParallelConfig(ring=2),
    }
    flags = {"compiled": ["--compile"], "sharded": ["--shard-weights"]}
    for name, config in configs.items():
        _cli(_argv(folder, tmp_path / name, config, "--output-type", "latent", *flags.get(name, [])), 2)

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
    assert compiled["load_options"]["compile"] is True and [r["compiled_graphs"] for r in compiled["ranks"]] == [1, 1]
    sharded = json.loads((tmp_path / "sharded" / "report.json").read_text())
    assert [r["compiled_graphs"] for r in sharded["ranks"]] == [0, 0]
    whole = {c: sum(_bytes_on_disk(folder, c).values()) for c in ("transformer", "text_encoder")}
    staged = json.loads((tmp_path / "pipefusion" / "report.json").read_text())
    assert staged["config"]["pipefusion"] == 2
    # a stage holds its own block (the tiny transformer has 2) and everything outside the blocks
    on_disk = _bytes_on_disk(folder, "transformer")
    outside = sum(n for key, n in on_disk.items() if not key.startswith("transformer_blocks."))
    for r in staged["ranks"]:
        own = sum(n for key, n in on_disk.items() if key.startswith(f"transformer_blocks.{r['rank']}."))
        assert r["memory"]["parameter_bytes"]["transformer"] == outside + own, r["memory"]["parameter_bytes"]
    assert sharded["load_options"]["shard_weights"] is True
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
    from xdit_lab.output_folder import atomic_write

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


# ---- what can go wrong in a run, and the dtypes and outputs no other test runs (issue 38) ------------------


def _plain(*argv):
    """`xdit-lab ARGV` in a plain process (run_cli's, torchrun's environment left out): a world of one, as a user
    tries it before torchrun, with a port of its own."""
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    return run_cli(list(argv), torchrun=False, env=env, timeout_s=180)


def _error_lines(output: str) -> list[str]:
    """The lines `xdit-lab run` prints for an error (a library's own warnings left out)."""
    return [line for line in output.splitlines() if line.startswith("xdit-lab run: error:")]


def test_the_output_folder_is_checked_before_anything_is_loaded(folder, tmp_path):
    """An --output that is a file, and one under a file: exit 2 with one line naming it, before the model is
    read (the model named here does not exist: its error would come first if the folder were checked after)."""
    a_file = tmp_path / "taken"
    a_file.write_text("not a folder")
    for output, said in [
        (a_file, f"--output {a_file} is a file"),
        (a_file / "images", f"cannot write the outputs to {a_file}/images"),
    ]:
        job = _plain("run", "--model", str(tmp_path / "no-model"), "--prompt", "a cat", "--output", str(output))
        lines = _error_lines(job.output)
        assert job.codes == [2] and len(lines) == 1 and "Traceback" not in job.output, job
        assert lines[0].startswith(f"xdit-lab run: error: {said}"), lines[0]
    assert a_file.read_text() == "not a folder"


def test_a_write_failure_leaves_the_images_before_it_and_a_partial_report(folder, tmp_path):
    """Image 1's name is taken by a folder, so its rename fails after image 0 is written: exit 1 with one line
    naming 001.png, 000.png in place, report.json listing it, marked incomplete, and no temporary file left."""
    output = tmp_path / "out"
    (output / "001.png").mkdir(parents=True)
    job = _plain(*production.run_argv(folder, PROMPTS, ParallelConfig(), output, seed=SEED, **KWARGS))
    # one error line (libraries may log warnings of their own: torchao does in this venv)
    lines = _error_lines(job.output)
    assert job.codes == [1] and len(lines) == 1 and "Traceback" not in job.output, job
    assert lines[0].startswith(f"xdit-lab run: error: writing {output}/001.png failed (Is a directory)")
    assert "written before it: 000.png (listed in report.json, marked incomplete)" in lines[0]
    report = json.loads((output / "report.json").read_text())
    assert report["outputs"] == ["000.png"] and report["complete"] is False
    assert report["error"] == "writing 001.png failed: Is a directory"
    assert Image.open(output / "000.png").size == (16, 16) and np.asarray(Image.open(output / "000.png")).std() > 0
    assert sorted(p.name for p in output.iterdir()) == ["000.png", "001.png", "report.json"]


def test_a_hung_peer_ends_in_an_error_naming_the_rank_within_the_timeout(folder, tmp_path):
    """Under cfg 2 with --timeout 5, rank 1 is stopped (SIGSTOP, as a hung process) once the denoising loop
    runs; rank 0 waits in the next cfg all-gather and gives up 5 s later with one line naming itself, the
    collective and rank 1. (torchrun then waits 30 s for the stopped rank to take SIGTERM: the test kills it.)"""
    import signal
    import subprocess
    import threading
    import time

    import psutil

    command = production.torchrun_argv(2) + _run(
        folder, tmp_path / "out", ParallelConfig(cfg=2), "--timeout", "5", num_inference_steps=1000
    )
    command.remove("--no-progress")  # the progress bar says when the loop runs
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen, marks = [], {}

    def read():
        while chunk := proc.stdout.read(1):
            seen.append(chunk)
            if "stopped" in marks and "error" not in marks and "gave up" in "".join(seen[-400:]):
                marks["error"] = time.monotonic()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    stopped = None
    try:
        deadline = time.monotonic() + 180
        while stopped is None and time.monotonic() < deadline and proc.poll() is None:
            if "/1000 " in "".join(seen[-200:]):  # rank 0's bar: both ranks are in the loop
                workers = {
                    child.environ().get("LOCAL_RANK"): child
                    for child in psutil.Process(proc.pid).children(recursive=True)
                    if "xdit_lab.cli" in child.cmdline()
                }
                workers["1"].send_signal(signal.SIGSTOP)
                stopped, marks["stopped"] = workers["1"], time.monotonic()
            time.sleep(0.05)
        assert stopped is not None, "".join(seen)[-3000:]
        while "error" not in marks and time.monotonic() < marks["stopped"] + 60:
            time.sleep(0.1)
        try:  # rank 0 ends by itself after its error (it does not hang leaving the process group)
            workers["0"].wait(timeout=20)
            marks["rank 0 ended"] = time.monotonic()
        except psutil.TimeoutExpired:
            pass
        stopped.kill()  # what torchrun does 30 s after its SIGTERM, which a stopped process does not take
        proc.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        if stopped is not None and stopped.is_running():
            stopped.kill()
    text = "".join(seen).replace("\r", "\n")
    assert proc.returncode != 0 and "error" in marks, text[-3000:]
    waited = marks["error"] - marks["stopped"]
    # the timeout, not torch's 30 minutes; at least the 5 s it was told, less the time this test takes to see the
    # bar and stop rank 1 (rank 0 may enter the collective that much before the stop is marked: 4.9994 s was seen)
    assert 4.5 <= waited <= 25, waited
    assert "rank 0 ended" in marks, text[-3000:]
    lines = re.findall(r"xdit-lab run: error: [^\n]*", text)  # after the progress bar, on its line
    assert len(lines) == 1, text[-4000:]
    line = lines[0]
    assert line.startswith(
        "xdit-lab run: error: rank 0 of 2 gave up after --timeout 5 s generating, in the cfg all_gather"
    ), line
    assert "with rank 1: a peer did not answer" in line and "Timed out" in line, line
    assert "Traceback" not in text[: text.index(line)]  # torchrun's own report of a failed child may follow


def test_float16_bfloat16_and_a_video_as_gif(folder, tmp_path):
    """`--dtype bfloat16` under cfg 2 and `--dtype float16` on one rank (each given torchrun's environment: run_cli)
    give the latents of diffusers' own pipeline loaded in that dtype and run serially, within that dtype's rounding:
    every element within 2 units in the last place (2^-8 relative for bfloat16, 2^-11 for float16) of the element's
    size (at least the mean's; the tiny random model's latents reach 688). Measured: equal, bit for bit. The
    control, the float32 run those flags would give if they were ignored, is run and lies 9.5 (bfloat16) and 6.8
    (float16) units away. The report says the dtype, and the transformer's parameters take half of float32's bytes.
    A video family's frames (tiny Wan, 5 frames) are written as one GIF that reads back with 5 frames of the asked
    size."""
    from diffusers import DiffusionPipeline

    wan = save_tiny_pipeline("wan", tmp_path / "wan")
    video = dict(tiny_pipeline_kwargs("wan"), num_inference_steps=2, guidance_scale=3.0)
    runs = {
        "bfloat16": (2, ParallelConfig(cfg=2), folder, KWARGS, "latent"),
        "float16": (1, ParallelConfig(), folder, KWARGS, "latent"),
        "gif": (1, ParallelConfig(), wan, video, "pil"),
    }
    for name, (ranks, config, model, call, output_type) in runs.items():
        argv = production.run_argv(model, PROMPTS, config, tmp_path / name, seed=SEED, **call)
        _cli(argv + ["--output-type", output_type] + (["--dtype", name] if name != "gif" else []), ranks)

    def diffusers_latents(dtype):
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=dtype)
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            return pipe(PROMPTS, generator=torch.Generator().manual_seed(SEED), output_type="latent", **KWARGS).images

    float32 = diffusers_latents(torch.float32)
    for dtype, ulp in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11)):
        name = str(dtype).removeprefix("torch.")
        reference = diffusers_latents(dtype)
        latents = torch.load(tmp_path / name / "latents.pt")
        assert latents.dtype == dtype and reference.dtype == dtype
        scale = reference.float().abs() + reference.float().abs().mean()  # each element's size, the mean's at least
        deviation = ((latents.float() - reference.float()).abs() / scale).max()
        control = ((float32 - reference.float()).abs() / scale).max()  # measured: 9.5 ulps (bf16), 6.8 (fp16)
        assert deviation <= 2 * ulp < control, (name, float(deviation) / ulp, float(control) / ulp)
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["dtype"] == name and report["complete"] is True
        held = report["ranks"][0]["memory"]["parameter_bytes"]["transformer"]
        assert held * 2 == sum(
            p.numel() * 4 for p in DiffusionPipeline.from_pretrained(folder).transformer.parameters()
        )

    report = json.loads((tmp_path / "gif" / "report.json").read_text())
    assert report["outputs"] == ["000.gif", "001.gif"] and report["complete"] is True
    for name in report["outputs"]:
        gif = Image.open(tmp_path / "gif" / name)
        assert gif.format == "GIF" and gif.n_frames == video["num_frames"] == 5 and gif.size == (64, 64)
        frames = []
        for index in range(gif.n_frames):
            gif.seek(index)
            frames.append(np.asarray(gif.convert("RGB")))
        assert np.std(frames) > 0 and any(not np.array_equal(frames[0], f) for f in frames[1:])  # not one still


def test_image_to_image_and_inpainting_from_files_equal_diffusers(tmp_path):
    """`--pipeline-class FluxImg2ImgPipeline --image FILE` under ulysses 2, and `--pipeline-class
    FluxInpaintPipeline --image FILE --mask-image FILE` under ring 2, each on 2 ranks given torchrun's environment
    (run_cli), equal diffusers' own pipelines of those classes run serially on the same folder, with the files read
    by diffusers' load_image (1e-4); the report names the pipeline and each file's digest. Control: diffusers' image
    to image from another picture misses the run's latents (the file is what the run started from). A
    --control-image (a ControlNet's, read as --image is) that does not exist: exit 2 with one line naming it, before
    the model is read (the model named there does not exist)."""
    import hashlib

    import diffusers
    from diffusers.utils import load_image

    from xdit_lab.tiny import save_tiny_pipeline

    flux = save_tiny_pipeline("flux", tmp_path / "flux")
    pixels = torch.randint(0, 256, (16, 16, 3), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(tmp_path / "start.png")
    Image.fromarray(pixels.flip(1).numpy()).save(tmp_path / "other.png")  # the control's picture
    mask = np.zeros((16, 16), dtype=np.uint8)
    mask[:, :8] = 255  # the left half redrawn, the right half kept
    Image.fromarray(mask).save(tmp_path / "mask.png")
    call = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=4)
    runs = {  # name: (pipeline class, configuration, image files)
        "img2img": ("FluxImg2ImgPipeline", ParallelConfig(ulysses=2), dict(image="start.png")),
        "inpaint": ("FluxInpaintPipeline", ParallelConfig(ring=2), dict(image="start.png", mask_image="mask.png")),
    }
    for name, (pipeline_class, config, files) in runs.items():
        argv = production.run_argv(flux, PROMPTS, config, tmp_path / name, seed=SEED, **call)
        argv += ["--output-type", "latent", "--pipeline-class", pipeline_class]
        for argument, file in files.items():
            argv += ["--" + argument.replace("_", "-"), str(tmp_path / file)]
        _cli(argv, 2, timeout_s=300)
    missing = tmp_path / "no-such.png"
    refused = _plain(
        *["run", "--model", str(tmp_path / "no-model"), "--prompt", "a cat", "--output", str(tmp_path / "m")],
        *["--pipeline-class", "FluxControlNetPipeline", "--control-image", str(missing)],
    )
    lines = _error_lines(refused.output)
    assert refused.codes == [2] and len(lines) == 1, refused
    assert (
        lines[0]
        == f"xdit-lab run: error: --control-image {missing}: no such file; give the path of a PNG or JPEG image"
    )

    def reference(pipeline_class, **files):
        pipe = getattr(diffusers, pipeline_class).from_pretrained(flux)
        pipe.set_progress_bar_config(disable=True)
        images = {argument: load_image(str(tmp_path / file)) for argument, file in files.items()}
        with torch.no_grad():
            generator = torch.Generator().manual_seed(SEED)
            return pipe(PROMPTS, generator=generator, output_type="latent", **call, **images).images

    for name, (pipeline_class, _, files) in runs.items():
        expected = reference(pipeline_class, **files)
        latents = torch.load(tmp_path / name / "latents.pt")
        assert latents.shape == expected.shape
        assert (latents - expected).abs().max() <= 1e-4 * expected.abs().max(), name
        report = json.loads((tmp_path / name / "report.json").read_text())
        assert report["pipeline"] == pipeline_class, report["pipeline"]
        digests = {a: [hashlib.sha256((tmp_path / f).read_bytes()).hexdigest()] for a, f in files.items()}
        assert {a: [e["sha256"] for e in entries] for a, entries in report["image_files"].items()} == digests
        if name == "img2img":
            other = reference(pipeline_class, image="other.png")
            assert (latents - other).abs().max() > 10 * 1e-4 * other.abs().max()
