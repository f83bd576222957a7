"""LoadOptions.problems(): every refusal of what load_pipeline takes besides the degrees, a sentence each, for a
folder, before a weight is read; and load_pipeline raising those sentences, all at once, as the first one's kind.

One test per family of rules (compile, a cache, the pipeline class, the refusal table, on_host, quantization, LoRA), each with
a control that an allowed combination of the same options finds nothing.
"""

import dataclasses
import json
import re

import pytest
import torch

from xdit_lab import LoadOptions, ParallelConfig, ParallelConfigError, StepCache, load_pipeline
from xdit_lab.families import recipe_for
from xdit_lab.lora import LoraError
from xdit_lab.model_folder import read_model_folder, resolve_folder
from xdit_lab.quantization import QuantizationError
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline

SERIAL, TWO = ParallelConfig(), ParallelConfig(ulysses=2)


def _read(path):
    folder = read_model_folder(resolve_folder(path))
    return recipe_for(folder.pipeline_class), folder


@pytest.fixture(scope="module")
def digits():
    return _read("digits")  # a PixArt-Alpha pipeline: one text encoder, no LoRA loader in diffusers


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    return _read(save_tiny_pipeline("flux", tmp_path_factory.mktemp("flux")))


@pytest.fixture(scope="module")
def zimage(tmp_path_factory):
    return _read(save_tiny_pipeline("zimage", tmp_path_factory.mktemp("zimage")))


@pytest.fixture(scope="module")
def flux_controlnet(tmp_path_factory):
    """The tiny Flux pipeline with a ControlNet of one block of each kind, saved as FluxControlNetPipeline."""
    import diffusers

    parts = tiny_pipeline("flux").components
    config = {**parts["transformer"].config, "num_layers": 1, "num_single_layers": 2}
    pipe = diffusers.FluxControlNetPipeline(**parts, controlnet=diffusers.FluxControlNetModel.from_config(config))
    path = tmp_path_factory.mktemp("flux_controlnet")
    pipe.save_pretrained(path, safe_serialization=True)
    return _read(path)


def _said(options, read, config=SERIAL):
    """(the exception's name, the sentence) of each problem."""
    recipe, folder = read
    return [(problem.error.__name__, str(problem)) for problem in options.problems(recipe, folder, config)]


def test_keywords_build_the_options_and_a_mistyped_one_is_refused_by_name():
    base = LoadOptions(quantization="int8")
    options = LoadOptions.given(base, on_host="text_encoder_2", progress=False)
    assert options == LoadOptions(quantization="int8", on_host=("text_encoder_2",), progress=False)
    assert base.on_host == () and base.progress  # frozen: replaced, not changed
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.progress = False
    with pytest.raises(TypeError, match=r"'shard_wieghts' \(did you mean 'shard_weights'\?\)"):
        LoadOptions.given(None, shard_wieghts=True)
    assert LoadOptions.given() == LoadOptions()


def test_the_record_is_json_each_field_by_its_name(tmp_path):
    adapter = tmp_path / "style.safetensors"
    options = LoadOptions(
        torch_dtype=torch.bfloat16, cache=StepCache(0.2), lora=[(str(adapter), 0.5), ({"w": torch.zeros(1)}, 1.0)]
    )
    record = json.loads(json.dumps(options.to_record()))
    assert set(record) == {f.name for f in dataclasses.fields(LoadOptions)}
    assert record["torch_dtype"] == "torch.bfloat16"
    assert record["cache"] == {"threshold": 0.2, "method": "first_block"}
    assert record["lora"] == [[str(adapter), 0.5, "transformer"], ["a state dict", 1.0, "transformer"]]


def test_compile_refuses_pipefusion_and_takes_a_step_cache(digits):
    said = _said(LoadOptions(compile=True, cache=StepCache(0.1)), digits, ParallelConfig(pipefusion=2))
    assert [kind for kind, _ in said] == ["ParallelConfigError"]
    assert "compile=True does not take PipeFusion" in said[0][1]
    assert _said(LoadOptions(compile=True, cache=StepCache(0.1)), digits, TWO) == []  # compiled under ulysses


def test_what_parallelize_refuses_of_a_cache_or_compile_is_said_before_loading(digits, zimage):
    """The rules parallelize raises after the weights are read (an unknown compile backend, a family with no
    StepCache yet, a StepCache under the async schedule) are LoadOptions' too: said before a byte is read."""
    (said,) = _said(LoadOptions(compile="no_such_backend"), digits, TWO)
    assert said[0] == "ValueError" and "compile='no_such_backend'" in said[1] and "aot_eager" in said[1]
    (said,) = _said(LoadOptions(cache=StepCache(0.1)), zimage)
    assert said[0] == "ParallelConfigError" and "StepCache is not offered on zimage yet" in said[1]
    async_pf = ParallelConfig(pipefusion=2, pipefusion_schedule="async")
    (said,) = _said(LoadOptions(cache=StepCache(0.1)), digits, async_pf)
    assert said[0] == "ParallelConfigError" and "pipefusion_schedule='async'" in said[1]
    # the controls: a known backend, a family with a StepCache, the drained schedule
    assert _said(LoadOptions(compile="aot_eager"), digits, TWO) == []
    assert _said(LoadOptions(cache=StepCache(0.1)), digits, ParallelConfig(pipefusion=2)) == []


def test_a_cache_that_is_no_step_cache_is_refused_by_name(digits):
    """diffusers' cache configurations on a transformer without diffusers' CacheMixin (the digits model is a PixArt,
    whose diffusers pipeline runs no cache) are refused by name, before a weight is read and by parallelize, not run
    as a StepCache with their threshold (a MagCacheConfig once ran as one, giving another image than diffusers').
    An object cache= does not know is refused as a TypeError. (Where diffusers runs them, they run with one decision
    for every rank: tests/test_diffusers_cache.py.)"""
    import diffusers

    from xdit_lab import parallelize
    from xdit_lab.tiny import tiny_transformer

    caches = (diffusers.MagCacheConfig(threshold=0.1, calibrate=True), diffusers.FirstBlockCacheConfig(0.1))
    for config in (*caches, diffusers.TaylorSeerCacheConfig()):
        (said,) = _said(LoadOptions(cache=config), digits)
        assert said[0] == "ParallelConfigError", said
        assert f"cache={type(config).__name__}: pixart's PixArtTransformer2DModel takes no diffusers cache" in said[1]
        assert "xdit_lab.StepCache(threshold)" in said[1]
        with pytest.raises(ParallelConfigError, match=type(config).__name__):
            load_pipeline("digits", cache=config)  # before a weight is read: no world is joined for it
        with pytest.raises(ParallelConfigError, match=type(config).__name__):
            parallelize(tiny_transformer("pixart"), SERIAL, cache=config)
    (said,) = _said(LoadOptions(cache=dataclasses.make_dataclass("Mine", [("threshold", float)])(0.1)), digits)
    assert said[0] == "TypeError" and "is not a cache xdit_lab runs" in said[1]
    assert _said(LoadOptions(cache=StepCache(0.1)), digits) == []  # the control: our own cache


def test_a_pipeline_class_of_another_family_or_none_is_refused(digits):
    (said,) = _said(LoadOptions(pipeline_class="WanPipeline"), digits)
    assert said[0] == "ValueError" and re.search(r"'WanPipeline' is a wan pipeline, .* holds a pixart one", said[1])
    (said,) = _said(LoadOptions(pipeline_class="NoSuchPipeline"), digits)
    assert said[0] == "ValueError" and "xdit_lab does not run NoSuchPipeline" in said[1]
    assert _said(LoadOptions(pipeline_class="PixArtSigmaPipeline"), digits) == []  # the control: its own family


def test_the_refusal_table_gives_one_sentence_per_reason(flux, flux_controlnet):
    # compile refuses PipeFusion; a StepCache refuses the async schedule; a ControlNet refuses compile and the async
    # schedule (one reason, one sentence naming both): three reasons
    async_pf = ParallelConfig(pipefusion=2, pipefusion_schedule="async")
    said = _said(LoadOptions(compile=True, cache=StepCache(0.1)), flux_controlnet, async_pf)
    assert [kind for kind, _ in said] == ["ParallelConfigError"] * 3
    assert "compile=True does not take PipeFusion" in said[0][1]
    assert "a StepCache does not run under pipefusion_schedule='async'" in said[1][1]
    assert re.match(
        r"this pipeline runs a ControlNet, .* not yet with pipefusion_schedule='async', compile", said[2][1]
    )
    # one reason covering several arguments is one sentence that names them all
    (said,) = _said(LoadOptions(compile=True, quantization="int8"), flux_controlnet)
    assert said[1].endswith("not yet with quantization, compile: leave them out")
    # the controls: the same folders with what they run with (Kontext's reference image under PipeFusion too)
    assert _said(LoadOptions(cache=StepCache(0.1)), flux) == []
    assert _said(LoadOptions(), flux_controlnet, ParallelConfig(pipefusion=2)) == []
    assert _said(LoadOptions(pipeline_class="FluxKontextPipeline"), flux, ParallelConfig(pipefusion=2)) == []
    assert _said(LoadOptions(pipeline_class="FluxKontextPipeline", cache=StepCache(0.1)), flux, TWO) == []


def test_on_host_names_only_text_encoders(flux):
    (said,) = _said(LoadOptions(on_host=("vae", "text_encoder_9")), flux)
    assert said[0] == "ValueError"
    assert "on_host names 'vae', 'text_encoder_9'" in said[1] and "'text_encoder', 'text_encoder_2'" in said[1]
    assert _said(LoadOptions(on_host="text_encoder_2"), flux) == []


def test_offload_blocks_takes_a_whole_number_and_refuses_sharded_weights_and_compile(flux):
    for wrong in (-1, 1.5, "2", True):
        (said,) = _said(LoadOptions(offload_blocks=wrong), flux)
        assert (
            said[0] == "ValueError"
            and f"a whole number >= 1, or 0 or None for none offloaded; got {wrong!r}" in said[1]
        )
    said = _said(LoadOptions(offload_blocks=2, shard_weights=True, compile=True), flux, TWO)
    assert [kind for kind, _ in said] == ["ValueError"] * 2
    assert said[0][1].startswith("offload_blocks with shard_weights: FSDP2 keeps 1/N of every block")
    assert said[1][1].startswith("offload_blocks with compile: diffusers' group offloading moves")
    # the controls: on one rank nothing is sharded; with quantized weights, host-placed text encoders, PipeFusion and
    # a StepCache it composes; 0 and None are off
    assert _said(LoadOptions(offload_blocks=2, shard_weights=True), flux) == []
    composed = LoadOptions(offload_blocks=1, quantization="int8", on_host="text_encoder", cache=StepCache(0.1))
    assert _said(composed, flux, ParallelConfig(pipefusion=2)) == []
    assert _said(LoadOptions(offload_blocks=0, compile=True), flux, TWO) == []
    assert LoadOptions(offload_blocks=0).offloaded is None and LoadOptions(offload_blocks=3).offloaded == 3


def test_quantization_refuses_unknown_schemes_and_sharded_weights(flux):
    (said,) = _said(LoadOptions(quantization="int4"), flux)
    assert said[0] == "QuantizationError" and "no quantization scheme 'int4'" in said[1]
    (said,) = _said(LoadOptions(quantization="int8", shard_weights=True), flux, TWO)
    assert said[0] == "QuantizationError" and "quantization with shard_weights" in said[1]
    # the controls: on one rank nothing is sharded (load_pipeline warns), and int8 alone is taken
    assert _said(LoadOptions(quantization="int8", shard_weights=True), flux) == []
    assert _said(LoadOptions(quantization="int8", on_host="text_encoder"), flux, TWO) == []


def test_lora_entries_and_what_they_cannot_go_with(flux, digits, tmp_path):
    adapter = tmp_path / "style.safetensors"
    adapter.write_bytes(b"")  # only its presence is checked before loading
    wrong = [
        (str(tmp_path / "missing.safetensors"), 1.0),
        (str(adapter), "strong"),
        (str(adapter), 1.0, "transformer_2"),
    ]
    said = _said(LoadOptions(lora=wrong, fuse_lora=False, shard_weights=True), flux, TWO)
    assert [kind for kind, _ in said] == ["LoraError"] * 5  # every entry's, then what the adapters cannot go with
    assert said[0][1] == f"LoRA {tmp_path / 'missing.safetensors'}: no such file or folder"
    assert said[1][1] == "a LoRA's scale must be a number (1.0: as trained); got 'strong'"
    assert "one of 'transformer' in this folder; got 'transformer_2'" in said[2][1]
    assert said[3][1].startswith("fuse_lora=False") and said[4][1].startswith("lora with shard_weights")
    (said,) = _said(LoadOptions(lora=[(str(adapter), 1.0)]), digits)
    assert "PixArtAlphaPipeline has no LoRA loader in diffusers" in said[1]
    # the control: one adapter at a scale, fused into whole weights
    options = LoadOptions(lora=[(str(adapter), 0.8)])
    assert _said(options, flux, TWO) == []
    assert options.adapters == [(adapter, 0.8, "transformer")]


def test_load_pipeline_raises_every_sentence_at_once_as_the_first_ones_kind(flux):
    folder = flux[1].path
    with pytest.raises(ValueError) as raised:
        load_pipeline(folder, on_host="text_encoder_9", quantization="int4", progress=False)
    assert type(raised.value) is ValueError  # the first sentence's kind: on_host's
    said = str(raised.value)
    assert said == "; ".join(LoadOptions(on_host="text_encoder_9", quantization="int4").problems(*_read(folder)))
    assert "on_host names 'text_encoder_9'" in said and "no quantization scheme 'int4'" in said
    with pytest.raises(QuantizationError, match="quantization with shard_weights"):
        load_pipeline(folder, TWO, LoadOptions(quantization="int8"), shard_weights=True)  # a keyword wins
    with pytest.raises(ValueError, match="offload_blocks with shard_weights"):
        load_pipeline(folder, TWO, offload_blocks=1, shard_weights=True)  # before torch.distributed is joined
    with pytest.raises(LoraError, match="fuse_lora=False"):
        load_pipeline(folder, None, LoadOptions(lora=[({}, 1.0)]), fuse_lora=False)
