"""xdit_lab.lessons: the helpers of tutorials 08-11 (memory, measuring, production, families)."""

import json
import os
import sys
import time
import types

import numpy as np
import pytest
import torch
from PIL import Image

from xdit_lab import ParallelConfig
from xdit_lab.lab import engine
from xdit_lab.lab.measure import max_relative_difference
from xdit_lab.lessons import families, loading, production, timing
from xdit_lab.testing import run_on_ranks

PROMPTS = ["a handwritten 3", "a handwritten 7"]


def _digits_kwargs():
    from xdit_lab.digits import call_kwargs

    return call_kwargs(num_inference_steps=3)


def test_header_block_bytes_match_the_loaded_model():
    from diffusers import PixArtTransformer2DModel

    from xdit_lab.digits import DIGITS_DIR
    from xdit_lab.plan import plan_memory

    figures = loading.header_block_bytes(DIGITS_DIR)
    model = PixArtTransformer2DModel.from_pretrained(DIGITS_DIR / "transformer")
    blocks = sum(p.numel() * p.element_size() for p in model.transformer_blocks.parameters())
    assert figures["block_bytes"] == blocks
    assert sorted(figures["per_block"]) == [f"transformer_blocks.{i}" for i in range(len(model.transformer_blocks))]
    plan = plan_memory(DIGITS_DIR, ["transformer"], dtype=torch.float32)
    assert figures["component_bytes"] == plan.component_bytes["transformer"]


def _on_two_ranks():
    import torch.distributed as dist

    from xdit_lab.pipeline import load_pipeline

    rank = dist.get_rank()
    state = {"rank": rank}
    config = ParallelConfig(pipefusion=2)
    state["pipe"] = load_pipeline("digits", config, progress=False)
    staged = loading.rank_weights(state)
    session = state["pipe"].session(PROMPTS, seed=0, **_digits_kwargs())
    state["session"] = session
    calls = [timing.vae_decoder_calls(state)]
    walls = []  # this caller's own clock around each step, independent of PhaseTimings
    while not session.done:
        start = time.perf_counter()
        session.step()
        walls.append(time.perf_counter() - start)
    timings = engine.timings(state)
    reference = session.result(output_type="latent").images
    calls.append(timing.vae_decoder_calls(state))
    session.result(output_type="np")
    calls.append(timing.vae_decoder_calls(state))
    refused = loading.load_with_mmap_refused(state, "digits", config, PROMPTS, 0, _digits_kwargs())
    same = refused["latents"] is None or torch.equal(refused["latents"], reference)
    state["pipe"] = load_pipeline("digits", ParallelConfig(), progress=False)
    serial = loading.rank_weights(state)
    return dict(
        staged=staged,
        serial=serial,
        timings=timings,
        walls=walls,
        calls=calls,
        refusals=refused["refusals"],
        same=same,
        latents_from=refused["latents"] is not None,
    )


def test_engine_helpers_on_two_ranks():
    from xdit_lab.digits import DIGITS_DIR

    out = run_on_ranks(_on_two_ranks, 2, timeout_s=180)
    blocks = loading.header_block_bytes(DIGITS_DIR)["block_bytes"]
    assert [o["staged"]["blocks"] for o in out] == [[0, 2, 4], [2, 4, 4]]
    assert all(o["staged"]["block_bytes"] * 2 == blocks for o in out)
    assert all(o["staged"]["active"] and o["staged"]["parameter_bytes"]["vae"] > 0 for o in out)
    # serial on 2 ranks: rank 1 is idle and holds nothing, but planned the same
    assert out[0]["serial"]["active"] and out[0]["serial"]["block_bytes"] == blocks
    assert not out[1]["serial"]["active"] and out[1]["serial"]["parameter_bytes"] == {}
    assert out[1]["serial"]["plan_per_rank_bytes"] == out[0]["serial"]["plan_per_rank_bytes"]
    # timings before decoding: every step timed, no decode yet; the VAE runs only for images
    for o in out:
        assert len(o["timings"]["steps"]) == 3 and o["timings"]["decode"] == 0.0
        # each recorded step lies within the caller's clock around it; denoise covers every step, no more
        assert all(0 < step <= wall for step, wall in zip(o["timings"]["steps"], o["walls"]))
        assert max(o["timings"]["steps"]) < o["timings"]["denoise"] <= sum(o["walls"])
        assert o["calls"] == [0, 0, 1]
        # mmap refused: the stage's transformer by plain reads (never mapped), the rest by diffusers' disable_mmap retry
        assert o["refusals"]["safe_open"] == 0 and o["refusals"]["load_file"] >= 1
        assert o["same"]
    assert [o["latents_from"] for o in out] == [True, False]


def test_mmap_demo(tmp_path):
    from safetensors.torch import save_file

    tensors = {"big": torch.randn(256, 1024), "small": torch.arange(7), "half": torch.randn(5).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "w.safetensors")
    out = loading.mmap_demo(tmp_path / "w.safetensors")
    assert out["tensors"] == 3 and out["same_tensors"]
    assert out["tensor_bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert out["refusals"] == {"safe_open": 1, "load_file": 0}
    if sys.platform.startswith("linux"):
        assert out["mapped_while_open"] and not out["mapped_after_release"]
        assert out["plain_read_bytes"] >= out["tensor_bytes"]
        assert out["mmap_read_bytes"] < out["tensor_bytes"] / 100
    import safetensors

    assert safetensors.safe_open.__name__ != "refused"  # restored on the way out


def test_mmap_refused_restores_on_error():
    import safetensors.torch

    real = safetensors.torch.load_file
    with pytest.raises(KeyError):
        with loading.mmap_refused():
            raise KeyError("x")
    assert safetensors.torch.load_file is real


def test_timed_lab_runs_and_medians():
    counter = iter(range(100))

    class FakeSession:
        def run(self):
            return self

        def result(self, output_type):
            i = next(counter)
            return types.SimpleNamespace(
                timings=dict(
                    encode=i,
                    prepare=0.0,
                    steps=[i, i + 1],
                    denoise=2 * i + 1,
                    decode=0.0 if output_type == "latent" else 1.0,
                )
            )

    lab = types.SimpleNamespace(session=lambda prompts, seed, **kwargs: FakeSession())
    out = timing.timed_lab_runs(lab, PROMPTS, runs=3, warmup=2)
    assert [t["encode"] for t in out["warmup"]] == [0, 1] and [t["encode"] for t in out["runs"]] == [2, 3, 4]
    assert len(out["wall"]) == 3 and all(w >= 0 for w in out["wall"])
    medians = timing.phase_medians(out["runs"])
    assert medians == dict(encode=3, prepare=0.0, denoise=7, decode=0.0, step=3.5)
    with pytest.raises(ValueError, match="no timed runs"):
        timing.phase_medians([])


def test_run_argv_parses_back_to_the_same_call():
    from xdit_lab.cli import _build_parser

    config = ParallelConfig(pipefusion=2, num_patches=4, warmup_steps=2)
    argv = production.run_argv("digits", PROMPTS, config, "/tmp/out", seed=3, **_digits_kwargs())  # negative_prompt ""
    args = _build_parser().parse_args(argv)
    assert args.prompt == PROMPTS and args.negative_prompt == [""] and args.seed == 3
    assert (args.pipefusion, args.num_patches, args.warmup_steps, args.cfg) == (2, 4, 2, 1)
    kwargs = _digits_kwargs()
    assert (args.steps, args.guidance, args.height, args.width) == (
        kwargs["num_inference_steps"],
        kwargs["guidance_scale"],
        kwargs["height"],
        kwargs["width"],
    )
    assert dict(args.option) == {
        k: v
        for k, v in kwargs.items()
        if k not in ("num_inference_steps", "guidance_scale", "height", "width", "negative_prompt")
    }
    launcher = production.torchrun_argv(1, nnodes=2, node_rank=1, master_port=29999)
    assert launcher[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert launcher[3:] == [
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--nproc_per_node",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        "29999",
    ]
    c10d = production.torchrun_argv(1, nnodes=2, rdzv_endpoint="host-a:29400")  # torch's own parser reads it
    from torch.distributed.run import get_args_parser

    parsed = get_args_parser().parse_args(c10d[3:] + ["-m", "xdit_lab.cli"])
    assert (parsed.rdzv_backend, parsed.rdzv_endpoint, parsed.nnodes) == ("c10d", "host-a:29400", "2")
    standalone = production.torchrun_argv(2)  # one node: torchrun binds its own rendezvous port
    parsed = get_args_parser().parse_args(standalone[3:] + ["-m", "xdit_lab.cli"])
    assert (parsed.standalone, parsed.nproc_per_node) == (True, "2")
    for nodes, neither_or_both in ((2, {}), (1, {"master_port": 29999, "rdzv_endpoint": "host-a:29400"})):
        with pytest.raises(ValueError, match="master_port= .* or rdzv_endpoint="):
            production.torchrun_argv(1, nnodes=nodes, **neither_or_both)


def test_run_processes_and_timeout():
    done = production.run_processes(
        [[sys.executable, "-c", "print('one')"], [sys.executable, "-c", "import sys; sys.exit(3)"]], timeout_s=60
    )
    assert [d["returncode"] for d in done] == [0, 3] and done[0]["output"].strip() == "one"
    assert not any(d["timed_out"] for d in done)
    code = "import os; print(os.environ.get('XDIT_LAB_NODE'), sorted(os.sched_getaffinity(0)))"
    cores = sorted(os.sched_getaffinity(0))
    pinned = production.run_processes(
        [[sys.executable, "-c", code]], timeout_s=60, envs=[{"XDIT_LAB_NODE": "1"}], cpus=[{cores[-1]}]
    )
    assert pinned[0]["output"].split() == ["1", f"[{cores[-1]}]"]
    slow = production.run_processes([[sys.executable, "-c", "import time; time.sleep(30)"]], timeout_s=0.5)
    assert slow[0]["timed_out"] and slow[0]["returncode"] != 0


def test_read_run_images(tmp_path):
    pictures = [np.full((4, 4, 3), value, dtype=np.uint8) for value in (10, 200)]
    for i, picture in enumerate(pictures):
        Image.fromarray(picture).save(tmp_path / f"{i:03d}.png")
    (tmp_path / "report.json").write_text(json.dumps({"outputs": ["000.png", "001.png"]}))
    read = production.read_run_images(tmp_path)
    assert len(read) == 2 and all(np.array_equal(a, b) for a, b in zip(read, pictures))


def test_family_helpers():
    kwargs = families.family_call_kwargs("flux", steps=2)
    assert kwargs["num_inference_steps"] == 2 and kwargs["true_cfg_scale"] > 1
    assert "true_cfg_scale" not in families.family_call_kwargs("sd3")
    assert families.family_call_kwargs("cogvideox")["num_frames"] == 9
    assert families.family_call_kwargs("sd3", negative_prompt="blur")["negative_prompt"] == "blur"
    flux2 = families.family_call_kwargs("flux2", negative_prompt="blur")  # guidance-distilled: one branch
    assert not {"negative_prompt", "guidance_scale", "true_cfg_scale"} & set(flux2)
    video = types.SimpleNamespace(frames=torch.ones(1), images=None)
    assert families.output_latents(video) is video.frames
    assert families.output_latents(types.SimpleNamespace(images=torch.zeros(1))).shape == (1,)
    reference = torch.tensor([100.0, -200.0])
    assert max_relative_difference(torch.tensor([100.0, -199.0]), reference) == pytest.approx(1 / 200)
    with pytest.raises(ValueError, match="differ in shape"):
        max_relative_difference(torch.zeros(3), reference)


def test_adapter_source_quotes_the_entry_the_package_uses():
    """Tutorial 11's show-the-code: the quoted text, evaluated in its family's module, is the adapter the
    package uses (FAMILIES); a family that does not exist is named."""
    from xdit_lab.families import FAMILIES, family
    from xdit_lab.lessons.families import adapter_source

    for adapter in FAMILIES.values():
        source = adapter_source(adapter.family)
        assert source.startswith("ADAPTER = FamilyAdapter(") and source.endswith(")"), source
        quoted = eval(source.removeprefix("ADAPTER = "), vars(family(adapter.family)))
        assert quoted == adapter, adapter.family
    with pytest.raises(KeyError, match="no family 'Hunyuan'"):
        adapter_source("Hunyuan")
