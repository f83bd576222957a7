"""LTX-2 (LTX2Pipeline: a video with its audio) against diffusers' own pipeline, run serially from the same folder.

The video's tokens follow their shard and the audio stays whole on every rank (families/ltx2.py says why): under
ulysses 2, ring 2, cfg 2, dp 2, PipeFusion 2 warming up over every step and, on 4 ranks, ulysses 2 × ring 2,
cfg 2 × ulysses 2 and PipeFusion 2 × ulysses 2, the video's and the audio's latents equal diffusers' within 1e-4 · max(1, max |reference|) in
float32, and each step's bytes per group equal the closed form (xdit_lab.traffic), its video-to-audio attention's
merge, the audio's gather and the audio PipeFusion's stages hand on with each patch included. Control: the
video-to-audio attention on each rank's own video alone (Controls(merges_whole_queries=False)) misses the bound.
Stale PipeFusion (one warm-up step) is measured against a bound that both wrong K/V buffers exceed. What LTX-2 does
not run is refused by name: PipeFusion's async schedule, a StepCache, the pipeline's default spatio-temporal and
modality guidance."""

import pytest
import torch
from forward_traffic import session_traffic, traffic_mismatches, traffic_row

from xdit_lab import ParallelConfig, RankMesh, StepCache, comm_log, load_pipeline, parallelize
from xdit_lab.lessons.controls import wrong_stale_kv
from xdit_lab.models import Controls, parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer

PROMPTS, NEGATIVES = ["a red cat", "a blue dog"], ["", "a photo"]
STEPS = 2


def _call():
    return dict(tiny_pipeline_kwargs("ltx2"), num_inference_steps=STEPS, negative_prompt=list(NEGATIVES))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("ltx2", tmp_path_factory.mktemp("ltx2"))


@pytest.fixture(scope="module")
def reference(folder):
    """diffusers' LTX2Pipeline from the folder, run serially: the video's and the audio's latents, and the decoded
    frames and waveform."""
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    outputs = {}
    for output_type in ("latent", "pt"):
        out = pipe(prompt=list(PROMPTS), generator=torch.Generator().manual_seed(0), output_type=output_type, **_call())
        outputs[output_type] = (out.frames, out.audio)
    return outputs


def _errors(got, expected) -> list[tuple[float, float]]:
    """(max abs error, bound) of the video's and the audio's."""
    return [((g - e).abs().max().item(), 1e-4 * max(1.0, e.abs().max().item())) for g, e in zip(got, expected)]


def _runs(folder, configs, reference, decoded_under, control_under):
    """On every rank: each configuration's latents against diffusers' and its traffic against the closed form; the
    decoded video and audio under `decoded_under`; the control under `control_under`."""
    rows = []
    runs = [(config, None) for config in configs] + [(control_under, Controls(merges_whole_queries=False))]
    for config, controls in runs:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, controls=controls)
        planned = pipe.memory_plan_for(PROMPTS, **_call()).activation_bytes
        session = pipe.session(PROMPTS, seed=0, **_call()).run()
        result = session.result(output_type="latent")
        extra = session.prepared.extra
        row = dict(
            config=config.short(),
            control=controls is not None,
            errors=_errors((result.frames, result.audio), reference["latent"]),
            traffic=session_traffic(session),
            planned=planned["latents"][1],
            held=sum(t.numel() * t.element_size() for t in (session.prepared.latents, extra["audio_latents"])),
        )
        if config.pipefusion > 1:  # the stale K/V a stage keeps (its video-to-audio attention's too): held, planned
            stage = parallel_state(pipe.diffusers_pipeline.transformer).strategy
            row["kv"] = (
                sum(t.numel() * t.element_size() for b in stage.buffers.values() for t in (b.keys, b.values)),
                pipe.memory_plan_for(PROMPTS, **_call()).activation_bytes["stale K/V"][1],
                _planned_from_headers(folder, config, stage.blocks),
            )
        if config == decoded_under and controls is None:
            decoded = pipe(PROMPTS, generator=torch.Generator().manual_seed(0), output_type="pt", **_call())
            row["decoded"] = _errors((decoded.frames, decoded.audio), reference["pt"])
            # return_dict=False: (video, audio), as LTX2Pipeline returns them, not a one-tuple of the pair
            plain = session.result(output_type="latent", return_dict=False)
            row["plain"] = len(plain) == 2 and all(
                torch.equal(a, b) for a, b in zip(plain, (result.frames, result.audio))
            )
        rows.append(row)
    return rows


def _planned_from_headers(folder, config, blocks):
    """The stale K/V the planner gives a stage holding `blocks` before anything is loaded (plan/terms.py)."""
    from xdit_lab.model_folder import read_model_folder
    from xdit_lab.plan.terms import make_call, request_shape, stale_kv

    model = read_model_folder(folder, torch.float32)
    call = make_call(model, batch=len(PROMPTS), options=_call())
    return stale_kv(model, call, request_shape(model, call), config, blocks)


def _check(per_rank, configs):
    for rank, rows in enumerate(per_rank):
        assert [row["config"] for row in rows[:-1]] == [config.short() for config in configs]
        for row in rows:
            where = f"ltx2 {row['config']}{' control' if row['control'] else ''} rank {rank}"
            video, audio = row["errors"]
            if row["control"]:  # the audio read one rank's video: both streams drift past the bound
                assert video[0] > video[1] and audio[0] > audio[1], f"{where}: {row['errors']} within the bound"
                continue
            assert video[0] <= video[1] and audio[0] <= audio[1], f"{where}: {row['errors']}"
            assert len(row["traffic"]) == STEPS, where
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)
            config = next(c for c in configs if c.short() == row["config"])
            degrees = {g for g in ("ulysses", "ring", "cfg", "dp") if getattr(config, g) > 1}
            assert degrees <= {g for step in row["traffic"] for g in step["moved"]}, where
            assert row["planned"] == row["held"], f"{where}: planned {row['planned']}, held {row['held']}"
            if "kv" in row:  # held, planned on the loaded stage, planned from the folder's headers
                assert row["kv"][0] > 0 and len(set(row["kv"])) == 1, f"{where}: stale K/V {row['kv']}"
            assert row.get("plain", True), f"{where}: return_dict=False is not (video, audio)"
            for error, bound in row.get("decoded", ()):
                assert error <= bound, f"{where} decoded: {error:.3g} > {bound:.3g}"


def test_ltx2_equals_diffusers_pipeline_on_two_ranks(folder, reference):
    """ulysses 2, ring 2, cfg 2, dp 2, PipeFusion 2 warming up over every step: the video's and the audio's latents
    equal diffusers' LTX2Pipeline, each step's bytes the closed form's (under ulysses and ring the sp group moves the
    video's gather and the video-to-audio partials; under PipeFusion stage 0 hands on each patch's video and the
    audio, the last stage broadcasts both predictions), the plan's latents what the rank holds (and under PipeFusion
    its stale K/V); the decoded frames and waveform too (ulysses 2). Control: the audio attending to its rank's half
    of the video misses the bound."""
    configs = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2), ParallelConfig(dp=2)]
    configs.append(ParallelConfig(pipefusion=2, warmup_steps=STEPS))  # every step warms up: exact
    per_rank = run_on_ranks(_runs, 2, folder, configs, reference, configs[0], ParallelConfig(ulysses=2), timeout_s=500)
    _check(per_rank, configs)
    assert all("decoded" in rows[0] for rows in per_rank)


def test_ltx2_equals_diffusers_pipeline_on_four_ranks(folder, reference):
    """ulysses 2 × ring 2, cfg 2 × ulysses 2 and PipeFusion 2 × ulysses 2 warming up over every step (a stage's two
    ranks each keep their half of every patch's video K/V for the audio, merged as under ulysses), as on two ranks
    (the control under ring 2 × ulysses 2)."""
    configs = [ParallelConfig(ulysses=2, ring=2), ParallelConfig(cfg=2, ulysses=2)]
    configs.append(ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=STEPS))
    per_rank = run_on_ranks(_runs, 4, folder, configs, reference, None, configs[0], timeout_s=500)
    _check(per_rank, configs)


def _forward_and_refusals(folder):
    """The transformer with LTX-2's interleaved rotary ([B, S, D] tables, where the pipeline's split rotary gives
    [B, H, S, D / 2]) under ulysses 2, against its serial forward, video and audio; then what is refused."""
    model = tiny_transformer("ltx2", rope_type="interleaved")
    inputs = tiny_inputs("ltx2", batch=2, height=6, width=6)  # 72 video tokens, 5 audio tokens
    with torch.no_grad():
        expected = model(**inputs, return_dict=False)
        model = parallelize(model, ParallelConfig(ulysses=2))
        with comm_log() as log:
            got = model(**inputs, return_dict=False)
    refused = {}
    for name, attempt in (
        (
            "async",
            lambda: load_pipeline(folder, ParallelConfig(pipefusion=2, pipefusion_schedule="async"), progress=False),
        ),
        ("cache", lambda: load_pipeline(folder, ParallelConfig(ulysses=2), cache=StepCache(0.1), progress=False)),
        ("guidance", lambda: load_pipeline(folder, ParallelConfig(ulysses=2), progress=False).session(PROMPTS)),
    ):
        try:
            attempt()
        except Exception as error:  # noqa: BLE001 - the refusal's text is what is checked
            refused[name] = str(error)
    return dict(errors=_errors(got, expected), traffic=traffic_row(model, inputs, log, step=0), refused=refused)


def test_ltx2_forward_with_interleaved_rotary_and_refusals(folder):
    for rank, row in enumerate(run_on_ranks(_forward_and_refusals, 2, folder, timeout_s=300)):
        for error, bound in row["errors"]:
            assert error <= bound, f"rank {rank}: {row['errors']}"
        assert row["traffic"]["moved"] == row["traffic"]["expected"], row["traffic"]
        refused = row["refused"]
        assert "pipefusion_schedule='async'" in refused["async"] and "audio_hidden_states" in refused["async"], refused
        assert "StepCache" in refused["cache"] and "return two" in refused["cache"], refused
        assert "stg_scale=1.0" in refused["guidance"] and "give stg_scale=0.0" in refused["guidance"], refused


# ---- stale PipeFusion ----------------------------------------------------------------------------------------
# How far stale PipeFusion (pipefusion 2, 2 patches, 1 warm-up step) moves the tiny transformer's outputs from its
# serial forward: the largest relative L2 of the stale steps, per stream, on latents drifting 5% of their noise per
# step (torch 2.13 CPU, deterministic). Measured, real / read before write / zeros: video 2.46e-3 / 3.65e-3 /
# 2.68e-1, audio 6.85e-4 / 7.40e-3 / 1.20e-1. Each bound is 1.25 × the real figure; both wrong buffers exceed both.
STALE_L2 = dict(video=2.46e-3, audio=6.85e-4)
STALE_MARGIN, STALE_STEPS, DRIFT = 1.25, 3, 0.05


def _stale_steps(config, control=None):
    """STALE_STEPS calls of the tiny transformer (4 blocks: 2 a stage) on drifting latents, against its serial
    forward: per step the relative L2 of the video and the audio, the bytes beside the closed form."""
    model = tiny_transformer("ltx2", layers=4)
    base = tiny_inputs("ltx2", 4, height=8, width=8, seed=0)  # 128 video tokens, 5 audio tokens
    generator = torch.Generator().manual_seed(3)
    noise = {k: torch.randn(base[k].shape, generator=generator) for k in ("hidden_states", "audio_hidden_states")}
    inputs = [dict(base, **{k: base[k] + DRIFT * i * n for k, n in noise.items()}) for i in range(STALE_STEPS)]
    rows = []
    with torch.no_grad():
        reference = [model(**x, return_dict=False) for x in inputs]
        model = parallelize(model, config, controls=wrong_stale_kv(control))
        for step, (x, expected) in enumerate(zip(inputs, reference)):
            with comm_log() as log:
                got = model(**x, return_dict=False)
            relative = [((g - e).norm() / e.norm()).item() for g, e in zip(got, expected)]
            rows.append(dict(relative_l2=dict(zip(("video", "audio"), relative)), **traffic_row(model, x, log, step)))
    return rows


def _stale_runs():
    config = ParallelConfig(pipefusion=2, warmup_steps=1)
    return {control: _stale_steps(config, control) for control in (None, "zeros", "read before write")}


def test_ltx2_stale_pipefusion_within_its_bound():
    """One warm-up step, then stale K/V (the video's self-attention's and the video K/V its audio attends to): the
    warm-up step is exact, the stale ones deviate within STALE_MARGIN × the measured figure, video and audio; both
    wrong buffers (zeros, read before write) exceed both bounds; every run's bytes equal the closed form."""
    for rank, runs in enumerate(run_on_ranks(_stale_runs, 2, timeout_s=300)):
        for control, rows in runs.items():
            where = f"ltx2 pf2 {control or 'stale'} rank {rank}"
            assert not traffic_mismatches(rows, where), traffic_mismatches(rows, where)
            assert max(rows[0]["relative_l2"].values()) <= 1e-6, where  # the warm-up step: the whole video, exact
            for stream, measured in STALE_L2.items():
                deviation, bound = max(row["relative_l2"][stream] for row in rows[1:]), STALE_MARGIN * measured
                if control is None:
                    assert 1e-5 < deviation <= bound, f"{where} {stream}: {deviation:.3g} > {bound:.3g}"
                else:
                    assert deviation > bound, f"{where} {stream}: control {deviation:.3g} within {bound:.3g}"


def _real_layout_vae():
    """LTX-2's video VAE as published (4 × 4 pixels a latent's patch, residual upsamplings that halve the channels,
    32x and 8x), its widths divided by 32: what the tiny one (vaes.ltx2_vae) leaves out."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(0)
    return AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8, 16, 32, 64), decoder_block_out_channels=(8, 16, 32),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
    ).eval()  # fmt: skip


def _decode_in_bands(config, kind, shape):
    from xdit_lab.sharding import shard_range
    from xdit_lab.tiny import vaes
    from xdit_lab.vae import DECODED, apply_parallel_vae, band_group, ltx2_halo_bytes

    vae = vaes.ltx2_vae(0, 4) if kind == "tiny" else _real_layout_vae()
    z = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    mesh = RankMesh(config)
    group = band_group(mesh)
    me, parts_ = mesh.group_rank(group), mesh.group_size(group)
    start, stop = shard_range(shape[-2], parts_, me)
    with torch.no_grad():
        whole = vae.decode(z).sample
        scale = whole.shape[-2] // shape[-2]
        alone = vae.decode(z[..., start:stop, :]).sample  # the control: a band decoded by itself
        assert apply_parallel_vae(vae, mesh)
        with comm_log() as log:
            video = vae.decode(z).sample
    images = getattr(vae, DECODED)["images"]
    return dict(
        error=(video - whole).abs().max().item(),
        bound=1e-4 * max(1.0, whole.abs().max().item()),
        alone=(alone - whole[..., start * scale : stop * scale, :]).abs().max().item(),
        tags={(r.group, r.tag) for r in log.records},
        halo=sum(r.bytes_out for r in log.records if r.tag == "vae_halo"),
        expected=ltx2_halo_bytes(vae.config, (images, *shape[1:]), 4, (me > 0) + (me < parts_ - 1)),
    )


@pytest.mark.parametrize(
    "config, kind, shape",
    [
        (ParallelConfig(ulysses=2), "tiny", (2, 4, 3, 7, 5)),  # 4x: two bands of 4 and 3 latent rows
        (ParallelConfig(ulysses=2, ring=2), "published layout", (1, 4, 2, 9, 3)),  # 4 bands, two with both neighbours
    ],
    ids=lambda v: v.short() if isinstance(v, ParallelConfig) else None,
)
def test_ltx2_video_vae_decodes_in_bands(config, kind, shape):
    """LTX-2's video VAE in row bands equals its whole decode within 1e-4, its halo bytes vae.ltx2_halo_bytes'
    closed form, every collective tagged vae; the control, a band decoded alone, is far off."""
    for rank, out in enumerate(run_on_ranks(_decode_in_bands, config.world_size, config, kind, shape, timeout_s=300)):
        where = f"{config.short()} {kind} rank {rank}"
        assert out["error"] <= out["bound"], f"{where}: {out['error']:.3g} > {out['bound']:.3g}"
        assert out["alone"] > 100 * out["bound"], f"{where}: a band alone is not far off ({out['alone']:.3g})"
        assert out["tags"] == {("sp", "vae_halo"), ("sp", "vae_gather")}, where
        assert out["halo"] == out["expected"] > 0, where


def _generate(folder, output_dir):
    from xdit_lab.run import run_generation

    call = {k: v for k, v in _call().items() if k not in ("num_inference_steps", "negative_prompt", "height", "width")}
    size = tiny_pipeline_kwargs("ltx2")
    return run_generation(
        folder,
        list(PROMPTS),
        ParallelConfig(ulysses=2),
        output_dir,
        negative_prompts=list(NEGATIVES),
        steps=STEPS,
        height=size["height"],
        width=size["width"],
        options=call,
    )


def test_ltx2_run_writes_each_videos_audio_as_wav(folder, reference, tmp_path):
    """`xdit-lab run`'s generation (run_generation, under ulysses 2) writes each video's GIF and its audio beside
    it as NNN.wav at the vocoder's sampling rate, samples equal to diffusers' waveform within 16-bit rounding."""
    import json
    import wave

    from diffusers import DiffusionPipeline

    report = run_on_ranks(_generate, 2, folder, tmp_path / "out", timeout_s=300)[0]
    assert report["outputs"] == ["000.gif", "000.wav", "001.gif", "001.wav"]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["complete"]
    rate = DiffusionPipeline.from_pretrained(folder).vocoder.config.output_sampling_rate
    expected = reference["pt"][1].clamp(-1, 1)
    for i in range(len(PROMPTS)):
        with wave.open(str(tmp_path / "out" / f"{i:03d}.wav")) as got:
            assert (got.getframerate(), got.getnchannels(), got.getsampwidth()) == (rate, expected.shape[1], 2)
            frames = got.readframes(got.getnframes())
        samples = torch.frombuffer(bytearray(frames), dtype=torch.int16).view(-1, expected.shape[1]).T / 32767
        assert samples.shape == expected[i].shape
        assert (samples - expected[i]).abs().max().item() <= 1 / 32767 + 1e-4 * max(1.0, expected.abs().max().item())
