"""Header-only folders of the real models, and the planner proven on them at their real size.

Each folder is built once for this module (xdit_lab.real_models.save_header_only: configs as the
classes save them, safetensors headers at the stored dtype, the data a sparse hole). The bytes per
component are read back with safetensors' own reader and compared with the published totals of
/work/shared/REAL-MODELS.md: exactly where it gives bytes, within 0.5% where it gives ~ or GB. Then
the planner (xdit_lab.plan.plan_model) plans FLUX.1-dev, SD3.5-large, Wan2.1-T2V-14B, CogVideoX-5b and
LTX-2 on 2, 4 and 8 GPUs of 24 and 80 GB: the targets below, each beside its control (the replicated row,
which must not fit). No weight is ever materialized and no rank is spawned."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from xdit_lab.plan import GB, plan_model
from xdit_lab.real_models import REAL_MODELS, save_header_only

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
ELEMENT = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4}

# REAL-MODELS.md, "Published bytes per component (as stored)": a whole number where it gives bytes (exact), a
# float where it gives "~" or GB (approximate, within 0.5%).
PUBLISHED = {
    "FLUX.1-dev": dict(transformer=23_802_816_640, text_encoder_2=9_524_621_312, text_encoder=246_120_960, vae=168e6),
    "SD3.5-large": dict(
        transformer=16_292_561_536, text_encoder=0.247e9, text_encoder_2=1.389e9, text_encoder_3=9.525e9
    ),
    "PixArt-Σ-XL-2-1024-MS": dict(transformer=610_856_096 * 4, text_encoder=19.05e9),  # the file: 2,443,492,488 (below)
    "CogVideoX-5b": dict(transformer=11_140_566_144, text_encoder=9_524_621_312),
    "Wan2.1-T2V-14B": dict(transformer=28_576_983_168, text_encoder=22.72e9),
    "HunyuanVideo": dict(transformer=25_642_025_088, text_encoder=15_010_373_632),
    "Qwen-Image": dict(transformer=40_860_802_176, text_encoder=16_584_333_312),
    # Qwen3-4B's own index total (its embedding tied to the LM head, stored once); the transformer's is not published
    "FLUX.2-klein-4B": dict(text_encoder=8_044_936_192),
    "Z-Image-Turbo": dict(transformer=6.15e9 * 2),  # 6.15B parameters in bfloat16 (no byte total is published)
}
PLANNED = ["FLUX.1-dev", "SD3.5-large", "Wan2.1-T2V-14B", "CogVideoX-5b", "LTX-2"]
GPU_SETS = [(n, memory) for n in (2, 4, 8) for memory in (24 * GB, 80 * GB)]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    return {name: save_header_only(name, root / name.replace("Σ", "S")) for name in REAL_MODELS}


@pytest.fixture(scope="module")
def plans(folders):
    """One plan per model and GPU set (each reads only the folder's index, configs and headers)."""
    return {(name, n, memory): plan_model(folders[name], n, memory) for name in PLANNED for n, memory in GPU_SETS}


def stored(folder: Path) -> dict[str, tuple[str, tuple]]:
    """{tensor: (dtype, shape)} of a component folder, read with safetensors' own reader."""
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                found[key] = (part.get_dtype(), tuple(part.get_shape()))
    return found


@pytest.mark.parametrize("model, component", sorted((m, c) for m, parts in PUBLISHED.items() for c in parts))
def test_weight_bytes_equal_the_published_totals(folders, model, component):
    tensors = stored(folders[model] / component)
    total = sum(math.prod(shape) * ELEMENT[dtype] for dtype, shape in tensors.values())
    published = PUBLISHED[model][component]
    if isinstance(published, int):  # REAL-MODELS.md gives the bytes
        assert total == published
    else:
        assert abs(total - published) <= 0.005 * published, (total, published)


def test_the_published_traps_are_kept(folders):
    """A tied weight is stored once (T5's shared embedding); SD3.5's pos_embed buffer is stored; the
    PixArt file is byte for byte as long as the published one (header included)."""
    t5 = stored(folders["FLUX.1-dev"] / "text_encoder_2")
    assert "shared.weight" in t5 and "encoder.embed_tokens.weight" not in t5
    sd3 = stored(folders["SD3.5-large"] / "transformer")
    assert math.prod(sd3["pos_embed.pos_embed"][1]) == 89_653_248
    pixart = folders["PixArt-Σ-XL-2-1024-MS"] / "transformer" / "diffusion_pytorch_model.safetensors"
    assert pixart.stat().st_size == 2_443_492_488
    shards = sorted((folders["PixArt-Σ-XL-2-1024-MS"] / "text_encoder").glob("*.safetensors"))
    assert [round(f.stat().st_size / 1e9, 2) for f in shards] == [9.99, 9.06]  # the published two shards


def test_folders_are_sparse_and_load_as_diffusers_folders(folders):
    """du counts only the headers: the holes hold no disk; configs are what the classes read back."""
    from importlib import import_module

    import diffusers
    import transformers

    for name, folder in folders.items():
        used = int(subprocess.run(["du", "-s", "-B1", str(folder)], capture_output=True, text=True).stdout.split()[0])
        apparent = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        assert apparent > 1e9 and used < 2e6, (name, used, apparent)
        assert not [f for f in folder.rglob("*") if ".tmp" in f.name or f.name.startswith(".config-")]
        index = json.loads((folder / "model_index.json").read_text())
        assert index["_class_name"] == REAL_MODELS[name].pipeline_class
        for component, spec in REAL_MODELS[name].components.items():
            assert index[component] == [spec.library, spec.class_name]
            if spec.dtype is None:
                continue
            if spec.library != "transformers":  # diffusers', or a diffusers pipeline's own module (LTX-2's "ltx2")
                library = (
                    diffusers if spec.library == "diffusers" else import_module(f"diffusers.pipelines.{spec.library}")
                )
                config = getattr(library, spec.class_name).load_config(folder / component)
                assert config["_class_name"] == spec.class_name
            else:
                config = transformers.AutoConfig.from_pretrained(folder / component)
                assert config.architectures == [spec.class_name]


def test_ltx2_holds_its_published_shapes(folders):
    """LTX-2 (LTX2Pipeline) as diffusers' scripts/convert_ltx2_to_diffusers.py builds it at version 2.0: the
    audio-video transformer of 48 layers holds 18.9B parameters (the "19B" of ltx-2-19b-dev.safetensors, which
    holds it with the VAEs and the vocoder), its text connectors 1.43B (a component of their own, listed as
    ["ltx2", "LTX2TextConnectors"]: diffusers saves a pipeline's own modules under the pipeline's name), Gemma 3
    12B's text model 11.77B beside its SigLIP tower (0.42B), every component in bfloat16 as the script's dtype
    defaults say."""

    def parameters(component):
        return sum(math.prod(shape) for _, shape in stored(folders["LTX-2"] / component).values())

    index = json.loads((folders["LTX-2"] / "model_index.json").read_text())
    assert index["connectors"] == ["ltx2", "LTX2TextConnectors"] and index["vocoder"] == ["ltx2", "LTX2Vocoder"]
    assert parameters("transformer") == 18_876_174_592 and parameters("connectors") == 1_431_475_200
    encoder = stored(folders["LTX-2"] / "text_encoder")
    language = sum(math.prod(shape) for key, (_, shape) in encoder.items() if "language_model" in key)
    vision = sum(math.prod(shape) for key, (_, shape) in encoder.items() if "vision_tower" in key)
    assert (language, vision) == (11_766_034_176, 416_866_032)
    assert {
        dtype for part in ("transformer", "vae", "vocoder") for dtype, _ in stored(folders["LTX-2"] / part).values()
    } == {"BF16"}


def test_ltx2_plans_every_component_its_audio_latents_and_its_decode(folders):
    """`xdit-lab plan --model` for LTX-2 on two 80 GB GPUs at the pipeline's defaults (768 × 512, 121 frames, guidance
    4: two branches): every component's bytes are its stored parameters × 2 (bfloat16), the transformer's 18.9B
    included; the latents are the video's (128 channels × 16 latent frames × 16 × 24, float32 as the pipeline keeps
    them) and beside them the audio's (126 latent frames of 121 / 24 seconds at 25 a second, 8 channels × 16 mel bins,
    float32); the decode peak is LTX-2's video VAE's closed form, whole on one rank and the largest of 2 bands under
    ulysses 2, and nothing is left unknown."""
    from xdit_lab.plan import ltx2_decode_peak_bytes

    folder = folders["LTX-2"]
    rows = plan_model(folder, 2, 80 * GB)
    assert {row.request.branches for row in rows} == {2} and any(row.config.cfg == 2 for row in rows)
    ulysses = _row(rows, "ulysses2", False, "gpu")
    components = ("transformer", "connectors", "text_encoder", "vae", "audio_vae", "vocoder")
    stored_bytes = {c: 2 * sum(math.prod(shape) for _, shape in stored(folder / c).values()) for c in components}
    assert ulysses.weights == stored_bytes and ulysses.weights["transformer"] == 18_876_174_592 * 2
    assert (ulysses.request.height, ulysses.request.width) == (512, 768)
    assert ulysses.latents == (128 * 16 * 16 * 24 + 126 * 8 * 16) * 4
    vae = json.loads((folder / "vae" / "config.json").read_text())
    latent = (1, 128, 16, 16, 24)
    assert (
        ulysses.decode_peak
        == ltx2_decode_peak_bytes(vae, latent, 2, bands=2)
        < 0.6 * ltx2_decode_peak_bytes(vae, latent, 2)
    )
    cfg = _row(rows, "cfg2", False, "gpu")
    assert cfg.decode_peak == ltx2_decode_peak_bytes(vae, latent, 2)
    assert not any(row.unknown for row in rows) and ulysses.fits


def test_qwen_image_edit_2511_is_qwen_image_with_its_references_at_t_0(folders):
    """Qwen-Image-Edit-2511 (QwenImageEditPlusPipeline, a processor listed beside the tokenizer) stores Qwen-Image's
    transformer and text encoder tensor for tensor; its transformer's config differs in zero_cond_t alone. Planned
    at its size, PipeFusion has rows (patch i is band i of every image), their stale K/V that of the drawn image's
    tokens: the references' grids are known once the images are given (pipe.memory_plan_for counts them)."""
    edit, base = folders["Qwen-Image-Edit-2511"], folders["Qwen-Image"]
    for component in ("transformer", "text_encoder"):
        assert stored(edit / component) == stored(base / component), component
    configs = [json.loads((folder / "transformer" / "config.json").read_text()) for folder in (edit, base)]
    assert {k for k in configs[0].keys() | configs[1].keys() if configs[0].get(k) != configs[1].get(k)} == {
        "zero_cond_t"
    }
    assert configs[0]["zero_cond_t"] is True
    index = json.loads((edit / "model_index.json").read_text())
    assert index["processor"] == ["transformers", "Qwen2VLProcessor"]
    rows = plan_model(edit, 4, 80 * GB)
    pipefusion = [r for r in rows if r.config.pipefusion > 1]
    assert pipefusion and all(r.stale_kv > 0 for r in pipefusion)
    assert {r.config.ulysses for r in rows} >= {4}


def _row(rows, short, shard, placement):
    (row,) = [
        r for r in rows if r.config.short() == short and r.shard_weights == shard and r.text_encoders == placement
    ]
    return row


def test_flux_under_ulysses_4_with_sharded_weights_fits_in_12_gb(plans):
    rows = plans[("FLUX.1-dev", 4, 24 * GB)]
    control = _row(rows, "ulysses4", False, "gpu")  # today: everything whole on every rank
    weights = sum(control.weights.values())
    assert abs(weights / GIB - 31.4) < 0.05 and not control.fits
    assert control.weights["transformer"] == 23_802_816_640  # the published total, whole
    sharded = _row(rows, "ulysses4", True, "sharded")
    assert sharded.per_rank_bytes <= 12 * GB and sharded.fits
    assert 23_802_816_640 / 4 <= sharded.weights["transformer"] <= 1.001 * 23_802_816_640 / 4
    assert sharded.weights["text_encoder_2"] <= 1.001 * 9_524_621_312 / 4
    assert sharded.gather >= 3 * 339_831_296 * 2  # three double-stream blocks (REAL-MODELS.md) whole
    assert _row(rows, "ulysses4", True, "host").per_rank_bytes < sharded.per_rank_bytes
    assert sharded.gather_traffic > 0 and control.gather_traffic == 0


def test_flux_plans_tp2_ulysses2_beside_ulysses4_sharded_and_pf4(folders, plans):
    """The ranked plan lists tp where Flux has a tp plan: a tp2·ulysses2 rank holds held_weights' bytes (1/2 of each
    split tensor), beside ulysses4 with sharded weights and pf4; tp never with what parallelize refuses with it."""
    import torch

    from xdit_lab import ParallelConfig
    from xdit_lab.model_folder import read_model_folder
    from xdit_lab.plan.weights import held_weights

    rows = plans[("FLUX.1-dev", 4, 24 * GB)]
    tp = _row(rows, "ulysses2·tp2", False, "gpu")
    model = read_model_folder(folders["FLUX.1-dev"], torch.bfloat16)
    weights = held_weights(model, ParallelConfig(ulysses=2, tp=2), False, "gpu", None)[0]
    assert tp.weights == weights and 0.5 * 23_802_816_640 < weights["transformer"] <= 0.505 * 23_802_816_640
    assert _row(rows, "ulysses4", True, "sharded").fits and _row(rows, "pf4", False, "gpu")
    whole = _row(rows, "ulysses4", False, "gpu")
    assert tp.activation_traffic > whole.activation_traffic  # two all-reduces per block on top of its all-to-alls
    assert tp.cost.work_fraction == whole.cost.work_fraction and tp.gather_traffic == 0
    sharded = [r for r in rows if r.config.tp > 1 and r.shard_weights]  # tp's slices sharded over its weights group
    assert sharded and all(r.config.world_size // (r.config.tp * r.config.pipefusion) > 1 for r in sharded)
    for r in sharded:  # each tp rank's slices, FSDP2-sharded over the ranks of one tp coordinate (of one stage)
        planned = held_weights(model, r.config, True, r.text_encoders, None)[0]["transformer"]
        assert r.weights["transformer"] == planned < weights["transformer"], r.config.short()
    assert [r for r in rows if r.config.tp > 1 and r.config.pipefusion > 1]  # PipeFusion's stages split over tp
    sd3 = [r for r in plans[("SD3.5-large", 4, 24 * GB)] if r.config.tp > 1]  # its adapter's plan: 38 heads, 19 a rank
    assert sd3 and not [r for r in sd3 if r.config.tp == 4]  # tp 4 does not divide 38 heads: never listed


def test_flux_fits_two_24_gb_gpus_and_wan_fits_four_under_ulysses(plans):
    flux = plans[("FLUX.1-dev", 2, 24 * GB)]
    whole = [row for row in flux if not row.shard_weights and row.config.pipefusion == 1]
    assert flux[0].fits and all(not row.fits for row in whole if row.config.tp == 1)
    assert all(row.fits for row in whole if row.config.tp == 2)  # half the transformer per rank, nothing gathered
    wan = [r for r in plans[("Wan2.1-T2V-14B", 4, 24 * GB)] if r.config.short() == "ulysses4"]
    assert any(r.fits for r in wan) and not _row(wan, "ulysses4", False, "gpu").fits
    assert all(r.decode_peak and not r.unknown for r in wan)  # its VAE's decode peak is planned (below)


def test_wan_plans_its_video_decode_peak_whole_and_in_bands(folders, plans):
    """Wan2.1-T2V-14B's rows count the decode of its video (81 frames at 832 × 480, its call defaults: 21 latent
    frames of 60 × 104) from its VAE's config: the closed form of plan.wan_decode_peak_bytes (measured on tiny
    specimens in tests/test_vae.py), the largest of 4 bands under ulysses 4, a quarter of the whole decode's give
    or take the band's halos and the gathered video; `xdit-lab plan --wide` prints it."""
    from xdit_lab.plan import format_rows, wan_decode_peak_bytes
    from xdit_lab.real_models import REAL_MODELS

    vae = {"z_dim": 16, **REAL_MODELS["Wan2.1-T2V-14B"].components["vae"].kwargs}  # AutoencoderKLWan's defaults
    row = _row(plans[("Wan2.1-T2V-14B", 4, 24 * GB)], "ulysses4", True, "sharded")
    assert (row.request.frames, row.request.height, row.request.width) == (21, 480, 832)
    whole = wan_decode_peak_bytes(vae, (1, 16, 21, 60, 104), 2)
    assert row.decode_peak == wan_decode_peak_bytes(vae, (1, 16, 21, 60, 104), 2, bands=4)
    assert 0.24 * whole < row.decode_peak < 0.3 * whole and 4e9 < whole < 5e9, (row.decode_peak, whole)
    line = next(line for line in format_rows([row], wide=True).splitlines() if "ulysses4" in line)
    assert f"{row.decode_peak / GB:.2f}" in line.split() and "?" not in line.split()
    one = plan_model(folders["Wan2.1-T2V-14B"], 1, 80 * GB, height=720, width=1280)
    assert {r.decode_peak for r in one} == {wan_decode_peak_bytes(vae, (1, 16, 21, 90, 160), 2)}


def test_cogvideox_and_hunyuanvideo_plan_their_video_decode_peak(folders, plans):
    """CogVideoX-5b's and HunyuanVideo's rows count the decode of their video from their VAE's config (the closed
    forms of plan.cogvideox_decode_peak_bytes and hunyuan_decode_peak_bytes, measured on tiny specimens in
    tests/test_vae.py): CogVideoX-5b at its call defaults (49 frames at 720 × 480: 13 latent frames of 60 × 90) in
    4 bands under ulysses 4; HunyuanVideo at 720 × 1280 × 129 frames (33 latent frames of 90 × 160, decoded in
    tiles of 5 latent frames), where the mid attention's frame-causal mask of 72,000 tokens (a float32 `where`
    of 5.2e9 entries and its bool comparison, 26 GB) is counted below the last up block's activations (37 GB
    whole), and in 8 bands each rank holds its rows of both."""
    from xdit_lab.plan import cogvideox_decode_peak_bytes, format_rows, hunyuan_decode_peak_bytes

    cog = json.loads((folders["CogVideoX-5b"] / "vae" / "config.json").read_text())
    row = _row(plans[("CogVideoX-5b", 4, 24 * GB)], "ulysses4", True, "sharded")
    whole = cogvideox_decode_peak_bytes(cog, (1, 16, 13, 60, 90), 2)
    assert row.decode_peak == cogvideox_decode_peak_bytes(cog, (1, 16, 13, 60, 90), 2, bands=4) and not row.unknown
    assert 0.24 * whole < row.decode_peak < 0.3 * whole, (row.decode_peak, whole)
    line = next(line for line in format_rows([row], wide=True).splitlines() if "ulysses4" in line)
    assert f"{row.decode_peak / GB:.2f}" in line.split() and "?" not in line.split()
    hunyuan = json.loads((folders["HunyuanVideo"] / "vae" / "config.json").read_text())
    rows = plan_model(folders["HunyuanVideo"], 8, 80 * GB, height=720, width=1280)
    decode = {(r.config.sp_degree * r.config.pipefusion, r.decode_peak) for r in rows if r.config.vae_parallel}
    whole = hunyuan_decode_peak_bytes(hunyuan, (1, 16, 33, 90, 160), 2)
    mask = 72_000**2 * (4 + 1)
    assert (
        mask < whole < 1.5 * mask
        and (8, hunyuan_decode_peak_bytes(hunyuan, (1, 16, 33, 90, 160), 2, bands=8)) in decode
    )
    assert all(peak < whole / bands + mask / bands for bands, peak in decode if bands > 1)


def test_wan_2_2_a14b_plans_both_experts_and_its_decode(folders):
    """Wan2.2-T2V-A14B: two experts of Wan 2.1 14B's shape (transformer, transformer_2; model_index.json's
    boundary_ratio 0.875), each whole on a rank or sharded like the transformer, and Wan 2.1's VAE: its decode
    peak is Wan2.1-T2V-14B's."""
    folder = folders["Wan2.2-T2V-A14B"]
    index = json.loads((folder / "model_index.json").read_text())
    assert index["boundary_ratio"] == 0.875 and index["transformer_2"] == ["diffusers", "WanTransformer3DModel"]
    rows = plan_model(folder, 8, 80 * GB)
    whole = _row(rows, "ulysses8", False, "gpu")
    assert whole.weights["transformer"] == whole.weights["transformer_2"] == 28_576_983_168
    assert _row(rows, "ulysses8", True, "sharded").weights["transformer_2"] <= 1.001 * 28_576_983_168 / 8
    wan = _row(plan_model(folders["Wan2.1-T2V-14B"], 8, 80 * GB), "ulysses8", False, "gpu")
    assert whole.decode_peak == wan.decode_peak and not whole.unknown and rows[0].fits


@pytest.mark.parametrize("name", PLANNED)
def test_plans_at_real_size_rank_fitting_rows_first(plans, name):
    for n, memory in GPU_SETS:
        rows = plans[(name, n, memory)]
        fits = [r.fits for r in rows]
        assert fits == sorted(fits, reverse=True), (name, n)  # every fitting row above every other
        assert {r.config.world_size for r in rows} == {n}
        assert {(r.shard_weights, r.text_encoders) for r in rows} >= {(False, "gpu"), (True, "sharded"), (True, "host")}
        for row in rows:
            assert row.per_rank_bytes == sum(v for v in row.terms.values() if v is not None)
            assert row.fits == (row.per_rank_bytes <= memory)
        if memory == 80 * GB:  # more memory never fits fewer rows
            assert sum(fits) >= sum(r.fits for r in plans[(name, n, 24 * GB)])


def test_the_command_as_a_newcomer_calls_it(folders):
    """`python -m xdit_lab.cli plan --model ...` in a fresh process, this tree first on the path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    flux = str(folders["FLUX.1-dev"])
    done = subprocess.run(
        [sys.executable, "-m", "xdit_lab.cli", "plan", "--model", flux, "--world-size", "4"]
        + ["--gpu-memory", "24GB", "--json", "--top", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    (row,) = [
        r
        for r in rows
        if r["degrees"] == dict(dp=1, cfg=1, pipefusion=1, ring=1, ulysses=4, tp=1)
        and r["shard_weights"]
        and r["text_encoders"] == "sharded"
    ]
    assert row["fits"] and row["per_rank_bytes"] <= 12 * GB and isinstance(row["per_rank_bytes"], int)
    assert {"terms", "seconds_per_step", "traffic_bytes_per_step"} <= set(row)
    assert [r["fits"] for r in rows] == sorted((r["fits"] for r in rows), reverse=True)

    small = subprocess.run(
        [sys.executable, "-m", "xdit_lab.cli", "plan", "--model", flux, "--world-size", "2", "--gpu-memory", "8GiB"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert small.returncode == 0, small.stderr[-2000:]
    assert "nothing fits 2 × 8.59 GB: the smallest GPU that would is" in small.stdout
    assert "| " not in small.stdout and "GB/rank" in small.stdout


def _benchmark(script: str, arguments: list[str], folders) -> subprocess.CompletedProcess:
    """benchmarks/`script` run as a user runs it, on 24 GB GPUs, its header-only folders in `folders`."""
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *arguments, "--memory", "24GB", "--folders", str(folders)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        timeout=300,
    )


def test_the_benchmark_prints_the_best_fit_per_gpu_set(tmp_path):
    done = _benchmark("fit_real_models.py", ["--models", "FLUX.1-dev", "--gpus", "2", "4"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| FLUX.1-dev")]
    assert [row[1] for row in rows] == ["2 × 24 GB", "4 × 24 GB"]
    for row in rows:  # the best fit's GB per rank within the GPU, the replicated row beside it above it
        best, exact = float(row[2].rsplit(", ", 1)[1]), float(row[3].rsplit(", ", 1)[1])
        # without PipeFusion the transformer must be cut to fit: FSDP2's shards or a tp rank's half of it
        assert best <= 24 and exact <= 24 and ("sharded" in row[3] or "tp2" in row[3])
    assert float(rows[0][4].rstrip(" |")) > 24  # replicated FLUX on 2 GPUs does not fit


def test_the_video_benchmark_prints_the_best_fit_with_its_decode_peak(tmp_path):
    """benchmarks/fit_video_models.py for Wan2.1-T2V-14B on 1 and 8 GPUs of 24 GB: nothing fits one (its
    transformer alone is 28.6 GB), the smallest row said instead; on 8 the best fit is within 24 GB per rank with
    the decode's peak among its terms, larger at 720p than at 480p."""
    done = _benchmark("fit_video_models.py", ["--models", "Wan2.1-T2V-14B", "--gpus", "1", "8"], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.strip("| ").split(" | ") for line in done.stdout.splitlines() if line.startswith("| Wan2.1")]
    assert [row[1:3] for row in rows] == [[s, g] for s in ("480p", "720p") for g in ("1 × 24 GB", "8 × 24 GB")]
    for _, size, gpus, best, *terms in rows:
        weights, gather, request, stale, decode, total = map(float, terms)
        assert abs(weights + gather + request + stale + decode - total) < 0.03, (size, gpus, terms)
        assert (total <= 24) == (gpus == "8 × 24 GB") and decode > 0, (size, gpus, best)
        assert best.startswith("nothing fits") == (gpus == "1 × 24 GB"), best
    assert float(rows[3][8]) > float(rows[1][8])  # 720p's decode peak on 8 GPUs above 480p's


def test_the_published_configurations_ship_in_the_wheel_and_read_back(tmp_path):
    """published.json is package data: the wheel built from this tree (a copy, so no build folder is left
    here) holds it, and what it holds reads back as REAL_MODELS, every argument as published.json writes
    it and every shared configuration a component extends with its keys."""
    import shutil
    import zipfile

    from xdit_lab.real_models.table import PUBLISHED as PUBLISHED_JSON
    from xdit_lab.real_models.table import load_real_models

    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "xdit_lab", source / "xdit_lab", ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(tmp_path / "wheel")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("xdit_lab-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        shipped = archive.read("xdit_lab/real_models/published.json")
    assert shipped == PUBLISHED_JSON.read_bytes()
    (tmp_path / "published.json").write_bytes(shipped)
    assert load_real_models(tmp_path / "published.json") == REAL_MODELS

    written = json.loads(shipped)
    assert list(written["models"]) == list(REAL_MODELS)
    for name, model in written["models"].items():
        assert REAL_MODELS[name].pipeline_class == model["pipeline_class"]
        for part, component in model["components"].items():
            read = REAL_MODELS[name].components[part]
            assert (read.library, read.class_name) == (component["library"], component["class_name"])
            assert str(read.dtype).removeprefix("torch.") == component.get("dtype", "None")
            kwargs = dict(component.get("kwargs", {}))
            extended = kwargs.pop("$extends", None)
            while extended is not None:  # the shared configuration's keys, where the component does not set them
                shared = dict(written["configs"][extended])
                extended = shared.pop("$extends", None)
                kwargs = shared | kwargs
            assert json.loads(json.dumps(read.kwargs)) == kwargs  # tuples written as arrays
    assert REAL_MODELS["FLUX.1-dev"].components["vae"].kwargs["block_out_channels"] == (128, 256, 512, 512)
    assert REAL_MODELS["Qwen-Image"].components["text_encoder"].kwargs["rope_scaling"]["mrope_section"] == [16, 24, 24]
    klein = "FLUX.2-klein-4B"
    assert REAL_MODELS[klein].settings == {"is_distilled": True} == written["models"][klein]["settings"]


def _variant(folder, name):
    """A folder beside `folder` whose components are links to its own (its sparse weights are not copied, which
    would write them out whole), model_index.json copied to be changed, and no call_defaults.json."""
    variant = folder.with_name(name)
    variant.mkdir()
    for path in folder.iterdir():
        if path.name == "model_index.json":
            (variant / path.name).write_text(path.read_text())
        elif path.name != "call_defaults.json":
            (variant / path.name).symlink_to(path)
    return variant


def test_flux2_klein_plans_one_branch_and_its_qwen3_from_its_folder(folders):
    """FLUX.2-klein-4B's folder says is_distilled in its model_index.json: the planner plans one branch (no cfg 2
    row), and the text encoder whole at Qwen3-4B's published bytes; a request keeps Qwen3's three stacked states
    per prompt, 512 tokens × 7680 (3 × 2560) in bfloat16, beside the ids. Control: the same folder marked as the
    base model (is_distilled false) plans two branches and cfg 2 rows."""

    folder = folders["FLUX.2-klein-4B"]
    rows = plan_model(folder, 2, 80 * GB)
    assert rows and {row.config.cfg for row in rows} == {1} and {row.request.branches for row in rows} == {1}
    whole = _row(rows, "ulysses2", False, "gpu")
    assert whole.weights["text_encoder"] == 8_044_936_192 and whole.fits
    ids = (512 + 64 * 64) * 4 * 8  # txt_ids and img_ids at 1024², int64 (t, h, w, l)
    assert whole.conditioning == 512 * 3 * 2560 * 2 + ids
    base = _variant(folder, "FLUX.2-klein-base-4B")
    index = json.loads((base / "model_index.json").read_text())
    (base / "model_index.json").write_text(json.dumps(index | {"is_distilled": False}))
    rows = plan_model(base, 2, 80 * GB)
    assert {row.request.branches for row in rows} == {2} and any(row.config.cfg == 2 for row in rows)


def test_zimage_turbo_is_planned_from_its_folder(folders):
    """Z-Image-Turbo's rows: its transformer (6.15B parameters) and Qwen3-4B text encoder at their stored bytes on a
    rank that holds them whole, which fits one of two 24 GB GPUs under ulysses 2. PipeFusion 2 cuts its 32 stacked
    blocks (the image refiner's 2, then the 30 main layers) 16 and 16: a stage keeps the stale K/V of its 16
    attention layers for the 4096 image tokens at 1024² (a multiple of 32: no padding), 30 heads of 128, bfloat16.
    Its folder's call_defaults.json says what its model card does, 9 steps at guidance 0: one branch, so no cfg 2
    row. Control: the same folder without it plans ZImagePipeline's own guidance 5, two branches, and offers cfg 2."""

    folder = folders["Z-Image-Turbo"]
    assert json.loads((folder / "call_defaults.json").read_text()) == {"num_inference_steps": 9, "guidance_scale": 0.0}
    rows = plan_model(folder, 2, 24 * GB)
    staged = [row for row in rows if row.config.pipefusion > 1]
    assert staged and {row.stale_kv for row in staged} == {16 * 2 * 1 * 30 * 4096 * 128 * 2}
    assert all(row.weights["transformer"] < 0.55 * 6_154_908_736 * 2 for row in staged)  # about half the blocks
    assert {row.request.branches for row in rows} == {1} and {row.config.cfg for row in rows} == {1}
    whole = _row(rows, "ulysses2", False, "gpu")
    assert whole.weights["transformer"] == 6_154_908_736 * 2 and whole.weights["text_encoder"] == 4_022_468_096 * 2
    assert whole.fits
    plain = _variant(folder, "Z-Image-without-call-defaults")
    rows = plan_model(plain, 2, 24 * GB)
    assert {row.request.branches for row in rows} == {2} and any(row.config.cfg == 2 for row in rows)


def test_sana_plans_its_stages_whole_and_keeps_sums_and_edge_rows(folders):
    """Sana 1600M at 1024 px on 4 GPUs of 24 GB: rows under ulysses, ring, PipeFusion, cfg and dp, but none with
    PipeFusion and sequence shards together (its convolution over rows would need halos between every rank's
    pieces of a patch: refused by name, so not planned). A stage keeps no K/V (its self-attention is linear) but
    each patch's sums, [rows, 70, 33, 32] float32 per layer, and each patch's two edge rows of every feed-forward's
    input, [rows, 2240, 1, 32] (bfloat16) each. Gemma 2's 2,614,341,888 parameters in bfloat16, as stored. Its
    deep-compression VAE's decode peak has no closed form: every row says so, and why."""
    rows = plan_model(folders["Sana_1600M_1024px"], 4, 24 * GB)
    assert all(row.decode_peak is None and "linear attention) has no ledger" in row.unknown[0] for row in rows)
    configs = [row.config for row in rows]
    assert any(c.pipefusion > 1 for c in configs) and any(c.ulysses > 1 for c in configs)
    assert any(c.ring > 1 for c in configs) and any(c.cfg > 1 for c in configs)
    assert not any(c.pipefusion > 1 and c.sp_degree > 1 for c in configs)
    for row in rows:  # one prompt, two branches: rows per rank 2 / cfg / dp; 20 blocks over the stages
        c = row.config
        rows_per_rank, layers = 2 // (c.cfg * c.dp), 20 // c.pipefusion
        kept = layers * c.patches * rows_per_rank * (70 * 33 * 32 * 4 + 2 * 2240 * 32 * 2)
        assert row.stale_kv == (kept if c.pipefusion > 1 else 0), (c.short(), row.stale_kv, kept)
    whole = [row for row in rows if row.text_encoders == "gpu"]
    assert whole and {row.weights["text_encoder"] for row in whole} == {2 * 2_614_341_888}
    assert rows[0].fits


def test_hunyuanvideo15_plans_its_fixed_text_lengths_at_720p(folders):
    """HunyuanVideo-1.5 720p text to video on two 80 GB GPUs: its transformer (8.33B parameters, "8.3B" as published)
    and Qwen2.5-VL-7B's text model (7.07B) whole on a rank under ulysses 2, which would fit but for its VAE's decode:
    diffusers' untiled decode of all 121 frames at once needs about 100 GB per rank in 2 bands
    (plan.hunyuan15_decode_peak_bytes), so the row names the term that does not fit. The guider's scale 6 gives two
    branches, so cfg 2 is offered. At the default size (target_size 960 at 16:9: 720 × 1280, 121 frames: 31 × 45 × 80
    latents of 32 channels) a request keeps the latents in bfloat16 and per prompt and branch the pipeline's fixed
    lengths: Qwen's 1000 states and mask, ByT5's 256, the image's 729 embeddings (zeros for text to video)."""
    from xdit_lab.plan import hunyuan15_decode_peak_bytes

    folder = folders["HunyuanVideo-1.5-720p_t2v"]
    rows = plan_model(folder, 2, 80 * GB)
    assert {row.request.branches for row in rows} == {2} and any(row.config.cfg == 2 for row in rows)
    whole = _row(rows, "ulysses2", False, "gpu")
    assert whole.weights["transformer"] == 8_326_608_160 * 2 and whole.weights["text_encoder"] == 7_070_619_136 * 2
    assert (whole.request.height, whole.request.width) == (720, 1280)
    vae = json.loads((folder / "vae" / "config.json").read_text())
    assert whole.decode_peak == hunyuan15_decode_peak_bytes(vae, (1, 32, 31, 45, 80), 2, bands=2) > 80 * GB
    assert not whole.fits and whole.per_rank_bytes - whole.decode_peak <= 80 * GB
    assert whole.latents == 32 * 31 * 45 * 80 * 2
    assert whole.conditioning == 2 * (1000 * (3584 + 1) + 256 * (1472 + 1) + 729 * 1152) * 2
