"""A model's call defaults travel with its folder: the bundled digits model called as a newcomer calls it.

Each test calls the way the README shows, with nothing but a prompt and a seed; the reference is
stock diffusers' PixArtAlphaPipeline on the same folder, told the model card's arguments."""

import inspect
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from xdit_lab import ParallelConfig, load_pipeline
from xdit_lab.digits import DIGITS_DIR, call_kwargs, classify, load_digits_pipeline
from xdit_lab.testing import run_cli, run_on_ranks


def _newcomer_calls(config):
    """On every rank: the issue's call, then one with explicit arguments that must win."""
    pipe = load_pipeline("digits", config)
    image = pipe(["a handwritten 7"], generator=torch.Generator().manual_seed(0)).images[0]
    explicit = pipe(
        ["a handwritten 7"],
        generator=torch.Generator().manual_seed(0),
        num_inference_steps=3,
        guidance_scale=1.0,
        output_type="latent",
    )
    session = pipe.session("a handwritten 3", seed=0)
    return dict(
        image=np.asarray(image),
        explicit=explicit.images,
        explicit_steps=len(explicit.timings["steps"]),
        session_steps=session.num_steps,
        comm=explicit.comm_per_step[0],
    )


def test_digits_with_default_arguments_equal_stock_diffusers(one_thread):
    ranks = run_on_ranks(_newcomer_calls, 2, ParallelConfig(ulysses=2), timeout_s=180)
    stock = load_digits_pipeline()
    reference = stock(["a handwritten 7"], generator=torch.Generator().manual_seed(0), **call_kwargs()).images[0]
    explicit = stock(
        ["a handwritten 7"],
        generator=torch.Generator().manual_seed(0),
        **call_kwargs(num_inference_steps=3, guidance_scale=1.0),
        output_type="latent",
    ).images
    for out in ranks:
        assert out["image"].shape == (16, 16, 3)  # the model's size, not the family's 256-px bins
        assert np.abs(out["image"].astype(int) - np.asarray(reference).astype(int)).max() <= 1
        assert out["explicit_steps"] == 3 and out["session_steps"] == 20  # explicit wins; else the folder's 20
        assert (out["explicit"] - explicit).abs().max() <= 1e-4 * explicit.abs().max()
        assert out["comm"].get("ulysses", 0) > 0  # the run really was parallel
    assert classify([reference])[0] == 7


def test_a_folder_without_call_defaults_keeps_diffusers_defaults_and_errors(tmp_path):
    from diffusers import PixArtAlphaPipeline

    folder = tmp_path / "digits-stock"
    shutil.copytree(DIGITS_DIR, folder)
    (folder / "call_defaults.json").unlink()

    defaults, error = run_on_ranks(_defaults_and_error, 1, folder)[0]
    signature = inspect.signature(PixArtAlphaPipeline.__call__).parameters
    assert defaults == {name: signature[name].default for name in ("num_inference_steps", "guidance_scale")}
    assert error is not None and "resolution binning" in error
    with pytest.raises(ValueError):  # diffusers refuses a sample size of 16 with binning too
        load_digits_pipeline(folder)("a handwritten 7", num_inference_steps=1)


def _defaults_and_error(folder):
    pipe = load_pipeline(folder, ParallelConfig())
    try:
        pipe("a handwritten 7", seed=0)
    except ValueError as error:
        return pipe.call_defaults, str(error)
    return pipe.call_defaults, None


def test_a_wrong_call_defaults_file_is_named(tmp_path):
    folder = tmp_path / "digits-typo"
    shutil.copytree(DIGITS_DIR, folder)
    (folder / "call_defaults.json").write_text(json.dumps({"heigth": 16}))
    error = run_on_ranks(_load_error, 1, folder)[0]
    assert "call_defaults.json" in error and "heigth" in error and "height" in error


def _load_error(folder):
    try:
        load_pipeline(folder)
    except ValueError as error:
        return str(error)
    return None


def test_load_pipeline_in_a_plain_python_process():
    """No init_distributed, no config: a world of one, joined by load_pipeline itself."""
    code = (
        "from xdit_lab import load_pipeline\n"
        "from xdit_lab.digits import classify\n"
        "image = load_pipeline('digits')('a handwritten 7', seed=0).images[0]\n"
        "print('size', image.size, 'read', classify([image])[0])\n"
    )
    env = {"OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
        env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}, **env},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "size (16, 16) read 7" in proc.stdout


def test_the_cli_with_only_a_prompt(tmp_path):
    """`xdit-lab run --model digits --prompt ... --ulysses 2 --output DIR` on 2 ranks given torchrun's environment
    (run_cli): the folder's 20 steps, a 16-px image the classifier reads as the prompted 3, and ulysses traffic."""
    output = tmp_path / "out"
    job = run_cli(
        ["run", "--model", "digits", "--prompt", "a handwritten 3", "--ulysses", "2", "--output", str(output)], 2
    )
    assert job.codes == [0, 0], job
    report = json.loads((output / "report.json").read_text())
    assert report["steps"] == 20 and report["ranks"][0]["bytes_out_by_group"]["ulysses"] > 0
    from PIL import Image

    image = Image.open(output / "000.png")
    assert image.size == (16, 16) and classify([image])[0] == 3


def test_lab_session_with_only_a_prompt(tmp_path, monkeypatch):
    from xdit_lab.lab import Lab

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # a cluster profile of its own
    with Lab(n=2, timeout_s=90, collective_timeout_s=60) as lab:
        lab.load("digits", ParallelConfig(cfg=2))
        output = lab.session("a handwritten 3", seed=0).run().result()
    image = output.images[0]
    assert image.size == (16, 16) and len(output.timings["steps"]) == 20
    assert classify([image])[0] == 3
    assert output.comm_per_step[0].get("cfg", 0) > 0


def _guided_by_the_folder(folder, call):
    """On one rank: the folder's call with its defaults, and with HunyuanVideo-1.5's published scale given."""
    from xdit_lab.lessons.families import output_latents

    pipe = load_pipeline(folder, ParallelConfig(), progress=False)
    runs = [
        pipe(["a red kite"], seed=0, output_type="latent", **call, **given) for given in ({}, {"guidance_scale": 6.0})
    ]
    return [output_latents(run) for run in runs]


def test_hunyuanvideo15_guides_with_its_folders_guider(tmp_path):
    """HunyuanVideo15Pipeline guides with the guider its folder saves (its __call__ takes no guidance_scale), so a
    folder whose guider_config.json says 3.0 is guided at 3.0 by diffusers, and by load_pipeline's call without a
    guidance_scale (recipe.folder_defaults); the control, the family's published 6.0 given, is far off."""
    from diffusers import DiffusionPipeline

    from xdit_lab.lessons.families import output_latents
    from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

    folder = save_tiny_pipeline("hunyuanvideo15", tmp_path / "hv15")
    config_path = folder / "guider" / "guider_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "guidance_scale": 3.0}))
    call = dict(tiny_pipeline_kwargs("hunyuanvideo15"), num_inference_steps=2)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    expected = output_latents(
        reference(prompt=["a red kite"], generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    )
    bound = 1e-4 * max(1.0, expected.abs().max().item())
    ((folders_scale, published),) = run_on_ranks(_guided_by_the_folder, 1, folder, call)
    assert (folders_scale - expected).abs().max().item() <= bound
    assert (published - expected).abs().max().item() > 10 * bound
