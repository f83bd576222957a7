"""The planner's terms against what really happens, on tiny models (real sizes: test_real_models.py).

- latents and conditioning: each recipe's closed form (Recipe.planned_request) against what
  xdit_lab measures by running the family's own encode and prepare (pipe.memory_plan_for, itself
  checked against the tensors a rank holds in test_pipelines.py), for every family, at the tiny
  size and at the family's default size, one and two branches, float32 and bfloat16;
- sharded weights: a rank's share against torch's own FSDP2 (`fully_shard`, 3 gloo ranks, uneven
  chunks, SD3's buffer left whole); the gather buffer against the peak resident memory FSDP2 adds
  during a forward, with a control that keeps the blocks unsharded and exceeds the plan; the
  gather traffic against the bytes FSDP2's all-gathers receive;
- PipeFusion's forwards per step (the gather term's multiplier) counted on real ranks;
- the command's errors, each with what was wrong and what to do.
"""

import ctypes
import json
import re
import shutil

import pytest
import torch

from xdit_lab import ParallelConfig
from xdit_lab.cli import main
from xdit_lab.model_folder import ModelFolderError, read_component
from xdit_lab.plan import plan_model
from xdit_lab.plan.command import memory_size
from xdit_lab.real_models import Component, build_on_meta, stored_tensors, write_header_only_weights
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs, tiny_transformer

PROMPTS, NEGATIVES = ["a red cat", "a blue dog"], ["", "a photo"]
TRUE_CFG = ("flux", "hunyuanvideo", "qwenimage")  # two branches only with negative prompts
SIGMA = "PixArtSigmaPipeline"  # the pixart family's second pipeline (tiny_pipeline's pipeline_class)
# Flux2KleinPipeline's folders, by the setting each keeps in its model_index.json: the base model's two branches at
# its default guidance, the step-distilled model's one
KLEIN = {"flux2-klein": {"is_distilled": False}, "flux2-klein-distilled": {"is_distilled": True}}
# name: (tiny family, edits to the transformer's config, call changes): switches the real configs use
VARIANTS = {
    "pixart": ("pixart", {}, {}),
    "pixart-sigma": ("pixart", {}, {}),
    "pixart-1024-binned": ("pixart", {"sample_size": 128}, {"use_resolution_binning": True, "height": 40}),
    "sd3": ("sd3", {}, {}),
    "flux": ("flux", {}, {}),
    "flux2": ("flux2", {}, {}),  # Mistral 3's stacked states padded to max_sequence_length, int64 ids of 4 axes
    "flux2-klein": ("flux2", {}, {}),  # Qwen3's stacked states, as wide as the transformer's joint_attention_dim
    "flux2-klein-distilled": ("flux2", {}, {}),
    "cogvideox": ("cogvideox", {}, {}),
    "cogvideox-rotary": ("cogvideox", {"use_rotary_positional_embeddings": True}, {}),
    "wan": ("wan", {}, {}),
    "hunyuanvideo": ("hunyuanvideo", {}, {}),
    "qwenimage": ("qwenimage", {}, {}),
    # the prompts are 31 tokens in Qwen's template: max_sequence_length at their length plans them exactly (a
    # shorter one is refused by name: the pipeline would cut the prompts, tests/test_bad_input.py)
    "qwenimage-31-tokens": ("qwenimage", {}, {"max_sequence_length": 31}),
    "zimage": ("zimage", {}, {}),  # float32 latents whatever the dtype; each prompt's own Qwen3 tokens
    "sana": ("sana", {}, {}),  # float32 latents whatever the dtype, Gemma 2's states and an int64 mask
    "sana-1024-binned": ("sana", {"sample_size": 32}, {"use_resolution_binning": True, "height": 64}),
    # latents in the model's dtype; Qwen's, ByT5's and the image's tokens of fixed lengths, the masks in the model's
    # dtype; by default the model's target_size at 16:9
    "hunyuanvideo15": ("hunyuanvideo15", {}, {}),
    # the video's latents and the audio's (float32 whatever the dtype); the connectors' two texts and an int64 mask
    "ltx2": ("ltx2", {}, {}),
}
BOUNDED = ("qwenimage", "zimage")  # the text as long as the prompt: the plan's conditioning an upper bound
SIZE_KEYS = ("height", "width", "num_frames")


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    built, folders = {}, {}
    for name, (family, edits, _) in VARIANTS.items():
        cls = SIGMA if name.startswith("pixart-") else "Flux2KleinPipeline" if name in KLEIN else None
        key = (family, cls, name if name in KLEIN else None)
        if key not in built:
            made = tmp_path_factory.mktemp(family)
            built[key] = save_tiny_pipeline(family, made, pipeline_class=cls, **KLEIN.get(name, {}))
        folder = built[key]
        if edits:
            folder = tmp_path_factory.mktemp(name)
            shutil.copytree(built[key], folder, dirs_exist_ok=True)
            path = folder / "transformer" / "config.json"
            path.write_text(json.dumps({**json.loads(path.read_text()), **edits}))
        folders[name] = folder
    return folders


def _calls(name):
    """(kwargs, branches or None for the planner's own default): the tiny call, at the family's
    default size, and with negative prompts (true CFG where the family has it)."""
    family, _, changes = VARIANTS[name]
    tiny = {**tiny_pipeline_kwargs(family), **changes}
    default_size = {k: v for k, v in tiny.items() if k not in SIZE_KEYS}
    calls = [(tiny, None), (default_size, None)]
    if family in TRUE_CFG:
        calls.append(({**tiny, "negative_prompt": NEGATIVES, "true_cfg_scale": 2.0}, 2))
    if name == "flux2-klein":  # the base model: one branch at guidance 1, two with negative prompts
        calls += [({**tiny, "guidance_scale": 1.0}, None), ({**tiny, "negative_prompt": NEGATIVES}, 2)]
    return calls


def _measure(cases):
    """On one rank: the latents and conditioning memory_plan_for measures for each (folder, dtype, calls)."""
    from xdit_lab import load_pipeline

    measured = []
    for folder, dtype, calls in cases:
        pipe = load_pipeline(folder, ParallelConfig(), torch_dtype=getattr(torch, dtype), progress=False)
        for kwargs, _ in calls:
            plan = pipe.memory_plan_for(PROMPTS, **kwargs).activation_bytes
            measured.append((plan["latents"][1], plan["conditioning"][1]))
        pipe.close()
    return measured


def test_closed_forms_equal_what_the_encode_holds(tiny_folders):
    cases = [(name, dtype) for name in VARIANTS for dtype in ("float32", "bfloat16")]
    measured = run_on_ranks(
        _measure, 1, [(tiny_folders[name], dtype, _calls(name)) for name, dtype in cases], timeout_s=600
    )[0]
    measured = iter(measured)
    for name, dtype in cases:
        for kwargs, branches in _calls(name):
            latents, conditioning = next(measured)
            options = {k: v for k, v in kwargs.items() if k not in ("height", "width", "negative_prompt")}
            row = plan_model(
                tiny_folders[name],
                1,
                10**15,
                dtype=getattr(torch, dtype),
                height=kwargs.get("height"),
                width=kwargs.get("width"),
                batch=len(PROMPTS),
                use_cfg=None if branches is None else branches == 2,
                options=options,
            )[0]
            where = (name, dtype, sorted(kwargs))
            assert row.latents == latents, where
            if name in BOUNDED:  # the text is as long as the prompt: an upper bound, said so
                assert row.bounds and conditioning < row.conditioning, where
            else:  # Qwen-Image with max_sequence_length at the prompts' length: exact too
                assert row.conditioning == conditioning, where


# ---- FSDP2: shares, gather buffer and traffic against torch's own fully_shard -------------------------------


def _fsdp_shares(folders):
    """On every rank: the bytes this rank holds of each tiny transformer under fully_shard."""
    import diffusers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from xdit_lab.families import FAMILIES

    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    held = {}
    for name, folder in folders.items():
        config = json.loads((folder / "config.json").read_text())
        model = getattr(diffusers, config["_class_name"]).from_pretrained(folder)
        for block in FAMILIES[config["_class_name"]].blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        params = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
        buffers = sum(b.numel() * b.element_size() for b in model.buffers() if b.device.type != "meta")
        held[name] = params + buffers
    return held


def test_a_rank_holds_the_share_fsdp2_gives_it(tmp_path):
    folders = {}
    for family in ("flux", "sd3"):  # hidden 32 over 3 ranks: uneven chunks; SD3 saves its pos_embed buffer
        folders[family] = tmp_path / family
        tiny_transformer(family, seed=0).save_pretrained(folders[family])
    ranks = run_on_ranks(_fsdp_shares, 3, folders, timeout_s=300)
    for family, folder in folders.items():
        weights = read_component(folder, torch.float32)
        measured = [rank[family] for rank in ranks]
        assert weights.held(3) == max(measured) == measured[0], family  # the first rank holds the most
        assert max(measured) > weights.whole / 3  # torch.chunk's ceil, not an even third
    # SD3's pos_embed is a buffer (FSDP2 leaves it whole on every rank); its dim 0 is 1, so the first
    # rank would hold it whole even as a parameter: the busiest rank's share is the same either way
    sd3 = read_component(folders["sd3"], torch.float32)
    (buffer,) = [t for t in sd3.root if not t.parameter]
    assert buffer.shape[0] == 1 and min(rank["sd3"] for rank in ranks) > buffer.nbytes


BIG_FLUX = dict(  # blocks of 38 MB (float32), so that resident memory measures them above the noise
    patch_size=1, in_channels=16, num_layers=3, num_single_layers=3, num_attention_heads=4, attention_head_dim=128,
    joint_attention_dim=64, pooled_projection_dim=64, guidance_embeds=False, axes_dims_rope=(32, 48, 48),
)  # fmt: skip


def _resident():
    status = open("/proc/self/status").read()
    return [int(re.search(rf"{key}:\s+(\d+)", status).group(1)) * 1024 for key in ("VmRSS", "VmHWM")]


def _fsdp_forward_memory(kwargs):
    """On every rank: the peak resident memory a forward adds to the state before it and the bytes
    FSDP2's all-gathers receive in it, for: the blocks resharded after each forward (as planned; the
    second forward, past lazy initialisation), kept unsharded once gathered (the control: its first
    forward), and the model whole, unsharded (its second forward: activations alone)."""
    import diffusers
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from xdit_lab.families import FAMILIES
    from xdit_lab.tiny import tiny_inputs

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD fixed: freed buffers leave the RSS
    torch.set_num_threads(1)
    inputs = tiny_inputs("flux", batch=1, height=2, width=2, text_len=1)
    inputs.update(
        hidden_states=inputs["hidden_states"][..., : kwargs["in_channels"]],
        encoder_hidden_states=torch.randn(1, 1, kwargs["joint_attention_dim"]),
        pooled_projections=torch.randn(1, kwargs["pooled_projection_dim"]),
    )
    results = {}
    for variant in ("plain", "resharded", "kept"):
        with torch.device("meta"):
            model = diffusers.FluxTransformer2DModel(**kwargs).eval()
        if variant != "plain":
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in FAMILIES["FluxTransformer2DModel"].blocks(model):
                fully_shard(block, mesh=mesh, reshard_after_forward=variant == "resharded")
            fully_shard(model, mesh=mesh, reshard_after_forward=True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).normal_(0, 0.02)
        received = []
        gather = dist.all_gather_single

        def counted(output, input, *args, received=received, gather=gather, **kw):
            received.append(output.numel() * output.element_size() - input.numel() * input.element_size())
            return gather(output, input, *args, **kw)

        dist.all_gather_single = counted
        try:
            with torch.no_grad():
                if variant != "kept":  # a first forward: lazy initialisation, one-time allocations
                    model(**inputs)
                first = sum(received)
                base = _resident()[0]
                open("/proc/self/clear_refs", "w").write("5")  # restart the peak (VmHWM) here
                model(**inputs)
        finally:
            dist.all_gather_single = gather
        results[variant] = dict(peak=_resident()[1] - base, traffic=sum(received) - first)
        del model
    return results


def test_the_gather_buffer_and_traffic_are_what_fsdp2_adds(tmp_path):
    component = Component("diffusers", "FluxTransformer2DModel", BIG_FLUX, torch.float32)
    folder = tmp_path / "transformer"
    folder.mkdir()
    module = build_on_meta(component)
    module.save_config(folder)
    write_header_only_weights(folder, "diffusion_pytorch_model", stored_tensors(module, torch.float32))
    weights = read_component(folder, torch.float32)
    planned = weights.gather(3)
    ranks = run_on_ranks(_fsdp_forward_memory, 3, BIG_FLUX, timeout_s=300)
    for rank in ranks:
        gathered = rank["resharded"]["peak"] - rank["plain"]["peak"]  # the activations taken out
        assert 0.95 * planned <= gathered <= 1.01 * planned, (gathered, planned)  # measured: 0.998-1.000
        assert rank["kept"]["peak"] - rank["plain"]["peak"] > planned  # control: the blocks never resharded
        # traffic: each rank receives the other two ranks' padded shards of every parameter
        assert rank["resharded"]["traffic"] == 2 * weights.held(3)
        modelled = ParallelConfig(dp=3).cost(shard_weights=True).gather_weights * weights.whole
        assert modelled <= rank["resharded"]["traffic"] <= 1.03 * modelled


def _forwards_per_step(config, steps):
    """On every rank: how often each step runs this stage's blocks (each run re-gathers a block that
    FSDP2 resharded after its forward), counted on the stage's first block."""
    from xdit_lab import load_pipeline
    from xdit_lab.families import adapter_for

    pipe = load_pipeline("digits", config, progress=False)
    calls = [0]
    transformer = pipe.diffusers_pipeline.transformer
    first_block = adapter_for(transformer).blocks(transformer)[0]
    first_block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    session = pipe.session(["a handwritten 3"], seed=0, num_inference_steps=steps)
    counted = []
    for _ in range(steps):
        before = calls[0]
        session.step()
        counted.append(calls[0] - before)
    return counted


def test_pipefusion_runs_one_forward_per_patch_past_the_warmup():
    """The gather term's multiplier, counted: a stage runs (and all-gathers) its blocks once per patch."""
    config = ParallelConfig(pipefusion=2, num_patches=3, warmup_steps=1)
    ranks = run_on_ranks(_forwards_per_step, 2, config, 3, timeout_s=300)
    assert ranks == [[1, 3, 3], [1, 3, 3]]
    sharded = ParallelConfig(dp=2, pipefusion=2, num_patches=3)  # the same stages, each held by 2 ranks
    assert sharded.cost(shard_weights=True).gather_weights == pytest.approx(3 * (1 / 2) / 2)
    assert sharded.cost(shard_weights=False) == ParallelConfig(dp=2, pipefusion=2, num_patches=3).cost()
    assert sharded.cost().gather_weights == 0


# ---- the command's errors ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    return save_tiny_pipeline("flux", tmp_path_factory.mktemp("flux-cli"))


def _plan(capsys, *arguments):
    with pytest.raises(SystemExit) as raised:
        code = main(["plan", *arguments])
        raise SystemExit(code)
    out = capsys.readouterr()
    return raised.value.code, out.out, out.err


def _broken(tmp_path, flux_folder, name):
    folder = tmp_path / name
    shutil.copytree(flux_folder, folder)
    return folder


def test_the_command_plans_a_tiny_folder(capsys, flux_folder):
    code, out, _ = _plan(capsys, "--model", str(flux_folder), "--world-size", "2", "--gpu-memory", "1000000")
    assert code == 0 and "FluxPipeline" in out and "GB/rank" in out
    code, out, _ = _plan(capsys, "--model", str(flux_folder), "--world-size", "2", "--gpu-memory", "1000")
    assert code == 0 and "nothing fits 2 × 1e-06 GB: the smallest GPU that would is" in out


@pytest.mark.parametrize(
    "breakage, message",
    [
        ("no index", r"model_index\.json is missing .*complete diffusers pipeline folder"),
        ("a file", r"is a file, not a folder: pass the diffusers pipeline folder"),
        ("bad index", r"model_index\.json is not valid JSON .*save or copy it again"),
        ("no transformer", r"lists the component 'transformer' .*is missing: copy the whole pipeline folder"),
        ("header overruns", r"truncated or corrupt: its header claims .*save or copy it again"),
        ("bad header", r"corrupt safetensors header .*save or copy it again"),
    ],
)
def test_the_command_errors_say_what_to_do(capsys, tmp_path, flux_folder, breakage, message):
    folder = _broken(tmp_path, flux_folder, "broken")
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    if breakage == "no index":
        (folder / "model_index.json").unlink()
    elif breakage == "a file":
        folder = weights
    elif breakage == "bad index":
        (folder / "model_index.json").write_text('{"_class_name": "FluxPipeline",')
    elif breakage == "no transformer":
        shutil.rmtree(folder / "transformer")
    elif breakage == "header overruns":
        data = weights.read_bytes()
        weights.write_bytes((len(data) + 1).to_bytes(8, "little") + data[8:])
    else:
        data = weights.read_bytes()
        length = int.from_bytes(data[:8], "little")
        weights.write_bytes(data[:8] + b"{" * length + data[8 + length :])
    code, _, err = _plan(capsys, "--model", str(folder), "--world-size", "2", "--gpu-memory", "24GB")
    assert code == 2 and err.startswith("xdit-lab plan: error: ") and re.search(message, err), err


def test_gpu_memory_takes_the_forms_it_names(capsys, flux_folder):
    assert memory_size("24GB") == 24 * 10**9
    assert memory_size("22.5GiB") == int(22.5 * 2**30)
    assert memory_size("24000000000") == 24 * 10**9
    code, _, err = _plan(capsys, "--model", str(flux_folder), "--world-size", "2", "--gpu-memory", "lots")
    assert code == 2 and "24GB (10^9 bytes), 22.5GiB (2^30 bytes) or a byte count" in err and "'lots'" in err
    code, _, err = _plan(capsys, "--world-size", "2", "--gpu-memory", "24GB")
    assert code == 2 and "give --model FOLDER too" in err


def test_plan_model_refuses_what_it_cannot_plan(tmp_path, flux_folder):
    with pytest.raises(ModelFolderError, match="no model folder at"):
        plan_model(tmp_path / "nowhere", 2, 10**9)
    with pytest.raises(ValueError, match="height 30 not a multiple of 4"):
        plan_model(flux_folder, 2, 10**9, height=30, width=32)
    with pytest.raises(ValueError, match="gpu_memory_bytes must be a positive whole number"):
        plan_model(flux_folder, 2, "24GB")


# ---- the table a newcomer reads ---------------------------------------------------------------------------

DEFAULT_COLUMNS = ["#", "config", "weights", "text enc", "GB/rank", "fits", "work", "GB sent", "NVLink s", "PCIe s"]
TERMS = ["gather", "latents+cond", "stale K/V", "decode"]


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    """FLUX.1-dev's folder as headers over holes: the README's example, at its real sizes."""
    from xdit_lab.real_models import save_header_only

    return save_header_only("FLUX.1-dev", tmp_path_factory.mktemp("flux-dev") / "FLUX.1-dev")


def _columns(line: str) -> list[str]:
    """A table's header cut into its column names (two spaces or more apart; a name may hold one space)."""
    return re.split(r"\s{2,}", line.strip())


def _legend(out: str) -> dict[str, str]:
    """The legend under a table: each column's name and what it says (its wrapped lines joined)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Columns"))
    entries = {}
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        if line[2] != " ":  # a new entry; deeper lines go on the one before
            name, meaning = re.split(r"\s{2,}", line.strip(), maxsplit=1)
            entries[name] = meaning
        else:
            entries[name] += " " + line.strip()
    return entries


def test_the_default_table_keeps_to_100_columns_and_its_legend_names_each(capsys, flux_dev):
    """`plan --model` at the README's size: every line within 100 columns (the table was 222 wide, the line
    above it 150), the columns that rank a row and say whether it fits, each named in the legend, and one
    unit: GB (10^9), never GiB or MiB. The rows' figures are the plan's."""
    argv = ["--model", str(flux_dev), "--world-size", "4", "--gpu-memory", "24GB", "--top", "0"]
    code, out, _ = _plan(capsys, *argv)
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 100, max(out.splitlines(), key=len)
    assert "GiB" not in out and "MiB" not in out and "of 24 GB each" in out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("# "))
    assert _columns(header) == DEFAULT_COLUMNS
    legend = _legend(out)
    assert list(legend) == DEFAULT_COLUMNS
    assert "host memory" in legend["text enc"] and "gathered" in legend["text enc"] and "24 GB" in legend["fits"]
    assert "--wide" in legend["GB/rank"]
    rows = plan_model(flux_dev, 4, 24 * 10**9)
    printed = [_columns(line) for line in lines if re.match(r" *\d+  ", line)]
    assert len(printed) == len(rows)
    for cells, row in zip(printed, rows):
        assert cells[1:6] == [
            row.config.short(),
            "sharded" if row.shard_weights else "whole",
            row.text_encoders,
            f"{row.per_rank_bytes / 1e9:.2f}",
            "yes" if row.fits else "no",
        ]
        assert float(cells[7]) == pytest.approx(row.traffic_per_step / 1e9, abs=0.005)


def test_wide_shows_every_term_and_the_legend_says_each(capsys, flux_dev):
    """--wide: each component's weights and every other term of GB/rank, a column each, summing to it; the
    legend names each column, the lines around the table still within 100 columns."""
    argv = ["--model", str(flux_dev), "--world-size", "4", "--gpu-memory", "24GB", "--top", "5", "--wide"]
    code, out, _ = _plan(capsys, *argv)
    assert code == 0 and "GiB" not in out
    lines = out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("# "))
    components = ["transformer", "text_encoder", "text_encoder_2", "vae"]
    assert _columns(header) == DEFAULT_COLUMNS[:6] + components + TERMS + DEFAULT_COLUMNS[6:]
    assert list(_legend(out)) == _columns(header)
    assert "PipeFusion's stale" in _legend(out)["stale K/V"] and "FSDP2" in _legend(out)["gather"]
    table = lines[lines.index(header) : lines.index(header) + 6]  # the header and --top 5 rows
    assert [line.split()[0] for line in table] == ["#", "1", "2", "3", "4", "5"]
    assert all(len(line) <= 100 for line in lines if line not in table)
    for cells in map(_columns, table[1:]):
        terms = [float(x) for x in cells[6:14]]
        assert sum(terms) == pytest.approx(float(cells[4]), abs=0.05), cells


def test_why_says_what_ranks_each_row_above_the_next(capsys, flux_dev):
    """--why with --model (refused until now: 'the folder's configs say them'): a line per row, the first
    figure of the planner's own sort key in which it and the next row differ, named with both values.
    The lines' words are checked against fit_rank_key computed here; the JSON rows carry the same."""
    from xdit_lab.plan import fit_rank_key

    argv = ["--model", str(flux_dev), "--world-size", "4", "--gpu-memory", "24GB", "--top", "0", "--why"]
    code, out, _ = _plan(capsys, *argv)
    assert code == 0 and max(len(line) for line in out.splitlines()) <= 100
    rows = plan_model(flux_dev, 4, 24 * 10**9)
    said = out.split("Why each row ranks above the next (--why):\n")[1]
    reasons = re.findall(r"^  #(\d+): (.*(?:\n      .*)*)", said, flags=re.M)
    assert [int(i) for i, _ in reasons] == list(range(1, len(rows)))
    starts = ["fits, ", "less work per rank than", "as much work, less sent per step than"]
    starts += ["the same work and traffic as", "the same cost as", "the same cost and memory as"]
    decided = set()
    for (i, reason), row, below in zip(reasons, rows, rows[1:]):
        reason = " ".join(reason.split())
        first = next(j for j, (a, b) in enumerate(zip(fit_rank_key(row), fit_rank_key(below))) if a != b)
        decided.add(first)
        assert reason.startswith(starts[first] if first < len(starts) else "ties with"), (i, reason, first)
        assert f"#{int(i) + 1}" in reason
        if first == 0:
            assert row.fits and not below.fits and f"{below.per_rank_bytes / 1e9:.2f} GB" in reason
        if first == 2:
            assert f"{row.traffic_per_step / 1e9:.2f} vs" in reason
    assert {0, 1, 2, 3} <= decided  # the plan exercises the figures a newcomer meets
    code, out, _ = _plan(capsys, *argv, "--json", "--top", "3")
    found = json.loads(out)
    assert [row["why_above_the_next"] for row in found] == [" ".join(r.split()) for _, r in reasons[:3]]


def test_every_figure_is_in_decimal_units(flux_dev):
    """GB as GPUs are sold (10^9 bytes), in the planner's neighbours too: the byte formatter of memory plans and
    errors, the Lab's axes, its folder planning, tutorial 14's table. Each said GiB or MiB (2^30, 2^20)."""
    from xdit_lab.lab.folder_planning import plan_folder
    from xdit_lab.lab.views import _scale
    from xdit_lab.lessons.fitting import terms_table
    from xdit_lab.plan import human_bytes

    assert [human_bytes(n) for n in (999, 2_500, 2_500_000, 31.4e9)] == ["999 B", "2.5 KB", "2.5 MB", "31.4 GB"]
    assert _scale(3e9) == (10**9, "GB") and _scale(2e6) == (10**6, "MB") and _scale(500) == (1, "B")
    plan = plan_folder(flux_dev, 2, "8GB")
    assert plan.smallest.startswith("nothing fits 2 × 8 GB") and "GiB" not in plan.smallest
    rows = plan_model(flux_dev, 4, 24 * 10**9)
    table = terms_table(rows[:2])
    assert "total GB" in table and "GiB" not in table
