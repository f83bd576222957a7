"""One folder reader (issue 56): a load reads each safetensors header once, through the one ModelFolder, and
the roles it gives each component decide what the plan counts and what the loaders do with it. A Wan 2.1
image-to-video folder (a CLIP image encoder beside the text encoder) is planned as it is loaded: its image
encoder whole and unquantized, under shard_weights=True and under quantization="int8", byte for byte."""

import collections
import contextlib
import pathlib
import sys

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.models.sharded_weights import held_checkpoint_bytes
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_wan_2_1_image_to_video


@contextlib.contextmanager
def counted_header_reads():
    """Count read_safetensors_header's calls by file, wherever the package bound its name."""
    from xdit_lab import safetensors_io

    original = safetensors_io.read_safetensors_header
    counts = collections.Counter()

    def counting(path):
        counts[str(path)] += 1
        return original(path)

    bound = [
        module
        for name, module in list(sys.modules.items())
        if name.startswith("xdit_lab") and getattr(module, "read_safetensors_header", None) is original
    ]
    for module in bound:
        module.read_safetensors_header = counting
    try:
        yield counts
    finally:
        for module in bound:
            module.read_safetensors_header = original


@contextlib.contextmanager
def counted_json_reads():
    """Count the package's reads of a folder's model_index.json and config.json files (Path.read_text, as
    model_folder reads them; diffusers' own from_pretrained opens them itself and is not counted)."""
    original = pathlib.Path.read_text
    counts = collections.Counter()

    def counting(self, *args, **kwargs):
        if self.name in ("model_index.json", "config.json"):
            counts[str(self)] += 1
        return original(self, *args, **kwargs)

    pathlib.Path.read_text = counting
    try:
        yield counts
    finally:
        pathlib.Path.read_text = original


def _count_one_load(folder, config, options):
    with counted_header_reads() as counts, counted_json_reads() as json_counts:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, **options)
    pipe.close()
    return dict(counts), dict(json_counts)


@pytest.fixture(scope="module")
def pixart(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


@pytest.mark.parametrize(
    "ranks, config, options",
    [
        (1, ParallelConfig(), {}),
        (1, ParallelConfig(), {"quantization": "int8"}),
        (2, ParallelConfig(ulysses=2), {"shard_weights": True}),
        (2, ParallelConfig(pipefusion=2), {}),
    ],
    ids=["whole", "int8", "sharded", "pipefusion"],
)
def test_a_load_parses_each_safetensors_header_once(pixart, ranks, config, options):
    """Each safetensors header parsed once, and model_index.json and each config.json read once, by one load."""
    files = {str(f) for f in pixart.rglob("*.safetensors")}
    for rank, (counts, json_counts) in enumerate(
        run_on_ranks(_count_one_load, ranks, pixart, config, options, timeout_s=300)
    ):
        assert counts == dict.fromkeys(files, 1), f"rank {rank}: headers parsed {counts}"
        assert (
            str(pixart / "model_index.json") in json_counts
            and str(pixart / "transformer" / "config.json") in json_counts
        )
        assert set(json_counts.values()) == {1}, f"rank {rank}: read {json_counts}"


def test_a_lora_under_pipefusion_reads_each_config_once(tmp_path_factory):
    """Fusing a LoRA into a PipeFusion stage renames its keys by the stage's blocks: from the configs the load read."""
    from test_lora import _folder_and_lora

    folder, lora = _folder_and_lora(tmp_path_factory, "flux")
    options = {"lora": [(str(lora), 0.7)]}
    for rank, (_, json_counts) in enumerate(
        run_on_ranks(_count_one_load, 2, folder, ParallelConfig(pipefusion=2), options, timeout_s=300)
    ):
        assert str(folder / "transformer" / "config.json") in json_counts
        assert set(json_counts.values()) == {1}, f"rank {rank}: read {json_counts}"


# ---- Wan 2.1 image to video: a CLIP image encoder, planned as loaded ------------------------------------------


@pytest.fixture(scope="module")
def wan_2_1_i2v(tmp_path_factory):
    """Wan 2.1 I2V's layout (xdit_lab.tiny.tiny_wan_2_1_image_to_video): CLIP image embeddings beside the text,
    a CLIP vision tower as image_encoder."""
    folder = tmp_path_factory.mktemp("wan_2_1_i2v")
    tiny_wan_2_1_image_to_video().save_pretrained(folder, safe_serialization=True)
    return folder


def _planned_and_held(folder, config, options):
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, **options)
    modules = {n: c for n, c in pipe.diffusers_pipeline.components.items() if isinstance(c, torch.nn.Module)}
    found = dict(
        planned=dict(pipe.memory_plan.per_rank_bytes),
        held={n: held_checkpoint_bytes(c) for n, c in modules.items()},
        sharded={n: any(hasattr(p, "to_local") for p in c.parameters()) for n, c in modules.items()},
        quantized={
            n: any(type(p).__module__.startswith("torchao") for p in c.parameters()) for n, c in modules.items()
        },
    )
    pipe.close()
    return found


@pytest.mark.parametrize(
    "ranks, config, options",
    [(2, ParallelConfig(ulysses=2), {"shard_weights": True}), (1, ParallelConfig(), {"quantization": "int8"})],
    ids=["sharded", "int8"],
)
def test_wan_2_1_image_encoder_is_planned_as_it_is_loaded(wan_2_1_i2v, ranks, config, options):
    rank0 = run_on_ranks(_planned_and_held, ranks, wan_2_1_i2v, config, options, timeout_s=300)[0]
    planned, held = rank0["planned"], rank0["held"]
    assert "image_encoder" in held
    assert planned["image_encoder"] == held["image_encoder"], f"planned {planned}, held {held}"
    for name in held:  # the busiest rank (rank 0) holds what its plan counts, component by component
        assert planned[name] == held[name], f"{name}: planned {planned[name]}, held {held[name]}"
    kind = "sharded" if "shard_weights" in options else "quantized"
    assert rank0[kind]["transformer"] and rank0[kind]["text_encoder"]  # the placement was applied where planned


def test_the_planner_keeps_an_image_encoder_whole_and_unquantized(wan_2_1_i2v):
    """`xdit-lab plan --model` moves the text encoders only (sharded, on the host, quantized): the image encoder
    is whole on every rank in every row, as load_pipeline loads it."""
    from xdit_lab.model_folder import read_model_folder
    from xdit_lab.plan import plan_model

    whole = read_model_folder(wan_2_1_i2v).weights["image_encoder"].whole
    rows = [*plan_model(wan_2_1_i2v, 2, 10**12), *plan_model(wan_2_1_i2v, 2, 10**12, quantize="int8")]
    assert {row.text_encoders for row in rows} == {"gpu", "sharded", "host"}
    assert any(row.quantize for row in rows) and any(row.shard_weights for row in rows)
    for row in rows:
        assert row.weights["image_encoder"] == whole, f"{row.config.short()} {row.text_encoders}: {row.weights}"
    assert "image_encoder" not in rows[0].request.text_encoders


def test_the_heads_a_degree_is_checked_against_are_read_as_the_family_spells_them(tmp_path):
    """The advice before a load (`xdit-lab run`, `Lab.load`) reads the transformer's heads from its config.json,
    through the family's adapter: Z-Image spells them n_heads, so a ulysses degree above them is refused before
    anything loads, naming the heads; Flux's num_attention_heads as before. Control: a config without the family's
    class name says nothing (None), and the load itself names what is wrong."""
    import json

    from xdit_lab.model_folder import transformer_heads

    zimage, flux = save_tiny_pipeline("zimage", tmp_path / "zimage"), save_tiny_pipeline("flux", tmp_path / "flux")
    assert (transformer_heads(zimage), transformer_heads(flux)) == (3, 4)
    with pytest.raises(ValueError, match="3 attention heads cannot give each of ulysses 4 ranks a head"):
        RankMesh.check(ParallelConfig(ulysses=4), 4, num_heads=transformer_heads(zimage))
    config = tmp_path / "zimage" / "transformer" / "config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "_class_name"}))
    assert transformer_heads(zimage) is None
