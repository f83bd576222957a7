"""DenoiseSession, batched prompts, input consistency, timings and clear errors (tiny PixArt)."""

import json
import shutil

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, load_pipeline
from xdit_lab.plan import MemoryPlanError
from xdit_lab.safetensors_io import CorruptWeightsError
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

KWARGS = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


def _step_by_step(folder, config):
    pipe = load_pipeline(folder, config, progress=False)
    session = pipe.session(["a red cat", "a dog"], negative_prompt="photo", seed=3, **KWARGS)
    seen = []
    while not session.done:
        seen.append((session.step_index, float(session.timestep)))
        session.step()
    stepped = session.result(output_type="latent")
    traffic = session_traffic(session)
    called = pipe(["a red cat", "a dog"], negative_prompt="photo", seed=3, output_type="latent", **KWARGS)
    return dict(
        seen=seen,
        equal=torch.equal(stepped.images, called.images),
        latents=tuple(session.latents.shape),
        timings=called.timings,
        steps_logged=len(called.comm_per_step),
        traffic=traffic,
        called_bytes=called.comm_per_step,
    )


def test_stepping_gives_exactly_the_call(folder):
    """Under cfg 2: step() by step() gives the call's latents bit for bit; every step's bytes equal the
    closed form, and the call moved the same bytes step by step."""
    for rank, out in enumerate(run_on_ranks(_step_by_step, 2, folder, ParallelConfig(cfg=2))):
        assert out["equal"]
        assert [i for i, _ in out["seen"]] == [0, 1, 2]
        assert len({t for _, t in out["seen"]}) == 3  # a new timestep each step
        timings = out["timings"]
        assert len(timings["steps"]) == 3 and out["steps_logged"] == 3
        assert timings["encode"] > 0 and all(seconds > 0 for seconds in timings["steps"])
        assert not traffic_mismatches(out["traffic"], f"rank {rank}"), out["traffic"]
        assert [{g: n for g, n in step.items() if n} for step in out["called_bytes"]] == [
            row["moved"] for row in out["traffic"]
        ]


def _batched(folder, config):
    prompts = ["a 1", "a 2", "a 3"]
    negatives = ["red", "blue", "green"]
    pipe = load_pipeline(folder, config, progress=False)
    session = pipe.session(
        prompts,
        negative_prompt=negatives,
        generator=[torch.Generator().manual_seed(10 + i) for i in range(3)],
        **KWARGS,
    ).run()
    batch = session.result(output_type="latent").images
    alone = [
        pipe(
            p, negative_prompt=n, generator=torch.Generator().manual_seed(10 + i), output_type="latent", **KWARGS
        ).images[0]
        for i, (p, n) in enumerate(zip(prompts, negatives))
    ]
    errors = [
        ((batch[i] - alone[i]).abs().max().item(), 1e-4 * max(1.0, alone[i].abs().max().item())) for i in range(3)
    ]
    return errors, session_traffic(session)


@pytest.mark.parametrize("config", [ParallelConfig(dp=2), ParallelConfig(cfg=2, dp=2)], ids=lambda c: c.short())
def test_image_i_belongs_to_prompt_i(folder, config):
    """3 prompts over dp 2 (2 + 1 per group): sample i equals prompt i generated on its own; each step
    of the batch moved the bytes of the closed form (dp pads its gather to the larger share)."""
    for rank, (rank_rows, traffic) in enumerate(
        run_on_ranks(_batched, config.world_size, folder, config, timeout_s=240)
    ):
        for i, (error, bound) in enumerate(rank_rows):
            assert error <= bound, f"sample {i}: {error:.3g} > {bound:.3g}"
        assert len(traffic) == 3 and not traffic_mismatches(traffic, f"rank {rank}"), traffic


def _mismatched(folder):
    import torch.distributed as dist

    pipe = load_pipeline(folder, ParallelConfig(ulysses=2), progress=False)
    prompt = "a red cat" if dist.get_rank() == 0 else "a blue cat"
    try:
        pipe.session(prompt, seed=0, **KWARGS)
    except ValueError as error:
        return str(error)


def test_ranks_with_different_inputs_fail_clearly(folder):
    messages = run_on_ranks(_mismatched, 2, folder)
    assert all(m and "ranks hold different inputs (prompts)" in m for m in messages)


def _latent_skips_vae(folder):
    pipe = load_pipeline(folder, ParallelConfig(), progress=False)

    def no_vae(*args, **kwargs):
        raise AssertionError("the VAE ran for output_type='latent'")

    pipe.diffusers_pipeline.vae.decode = no_vae
    out = pipe("a cat", seed=0, output_type="latent", **KWARGS)
    return tuple(out.images.shape)


def test_latent_output_skips_the_vae(folder):
    assert run_on_ranks(_latent_skips_vae, 1, folder)[0][1] == 4  # [batch, latent channels, h, w]


def _error(fn, *args):
    try:
        fn(*args)
    except Exception as error:  # the test checks type and message
        return type(error).__name__, str(error)
    return None


def _errors(folder, tmp):
    from pathlib import Path

    tmp = Path(tmp)
    config = ParallelConfig()
    out = {"missing": _error(load_pipeline, tmp / "nowhere", config)}
    unsupported = tmp / "unsupported"
    shutil.copytree(folder, unsupported)
    index = json.loads((unsupported / "model_index.json").read_text())
    (unsupported / "model_index.json").write_text(json.dumps(index | {"_class_name": "StableDiffusionPipeline"}))
    out["unsupported"] = _error(load_pipeline, unsupported, config)
    truncated = tmp / "truncated"
    shutil.copytree(folder, truncated)
    weights = next((truncated / "transformer").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-100])
    out["truncated"] = _error(load_pipeline, truncated, config)
    out["memory"] = _error(lambda: load_pipeline(folder, config, memory_limit_bytes=10_000))
    pipe = load_pipeline(folder, ParallelConfig(), progress=False)
    out["negatives"] = _error(lambda: pipe(["a", "b"], negative_prompt=["x"], **KWARGS))
    out["size"] = _error(
        lambda: pipe("a", height=30, width=32, **{k: v for k, v in KWARGS.items() if k not in ("height", "width")})
    )
    out["option"] = _error(lambda: pipe("a", strength=0.5, **KWARGS))
    one_step = {k: v for k, v in KWARGS.items() if k != "num_inference_steps"}
    out["one step"] = _error(lambda: pipe("a", num_inference_steps=1, **one_step))  # diffusers' own call fails too
    return out


def test_clear_errors(folder, tmp_path):
    out = run_on_ranks(_errors, 1, folder, str(tmp_path))[0]
    assert out["missing"][0] == "FileNotFoundError" and "no pipeline folder at" in out["missing"][1]
    assert "does not run StableDiffusionPipeline; supported pipelines: " in out["unsupported"][1]
    assert "PixArtAlphaPipeline" in out["unsupported"][1]
    assert out["truncated"][0] == CorruptWeightsError.__name__ and "truncated" in out["truncated"][1]
    assert out["memory"][0] == MemoryPlanError.__name__
    assert "per rank" in out["memory"][1] and "transformer" in out["memory"][1] and "pipefusion" in out["memory"][1]
    assert "2 prompts but 1 negative prompts" in out["negatives"][1]
    assert "height 30 not a multiple of 4" in out["size"][1] and "Sizes that fit serial: 4, 8" in out["size"][1]
    assert "do not take strength" in out["option"][1]
    assert "num_inference_steps=1 on PixArt" in out["one step"][1] and "use 2 steps or more" in out["one step"][1]


def _mmap_refused(folder):
    """The same generation from a normal load and from a load where safetensors refuses mmap."""
    from xdit_lab.lessons.loading import mmap_refused

    def generate(pipe):
        return pipe("a cat", seed=0, output_type="latent", **KWARGS).images

    normal = generate(load_pipeline(folder, ParallelConfig(), progress=False))
    with mmap_refused() as refusals:  # the file system refuses mmap; plain reads still work
        pipe = load_pipeline(folder, ParallelConfig(), progress=False)
    return dict(refusals=dict(refusals), normal=normal, refused=generate(pipe))


def test_mmap_failure_falls_back_to_plain_reads(folder):
    out = run_on_ranks(_mmap_refused, 1, folder)[0]
    assert out["refusals"]["load_file"] > 0  # the loaders did try to map the files, and were refused
    assert torch.equal(out["refused"], out["normal"]) and out["normal"].std() > 0
