"""Every bad input a user can give the Python API or a model folder ends in an error that names what was wrong
and what to do (issue 38, point 6), each beside a control that the same call with a good value runs.

- Call arguments: sizes and steps are whole numbers ≥ 1 or None (0 and negatives were taken for the defaults,
  or passed through), prompts are text and there is at least one, generator= or seed=, and a prompt longer than
  the family's max_sequence_length is refused with its tokens and the limit. Why refused and not warned:
  diffusers cuts such a prompt and draws the image without the cut words, with at most a logged warning (Wan,
  Qwen-Image, Flux.2 and HunyuanVideo's Llama none at all), and a log line on an engine never reaches the
  notebook; the boundary is checked against diffusers' own encode_prompt for every family.
- A configuration that breaks ParallelConfig's rules (cfg 3) is refused before the folder is looked at; one the
  folder's own settings rule out (cfg 2 on a step-distilled Flux.2 klein: one branch) before a weight is read.
- Folders: a file for a folder, a missing component folder, a model_index.json that is not JSON or not an
  index, a config.json that does not build the module its weights were saved from (more layers, fewer, wider;
  a text encoder and a VAE too), and corrupt safetensors (a short file, a header that runs past the end,
  a header that is not JSON or not tensors) through load_pipeline, the PipeFusion stage loader and the sharded
  loader: each a CorruptWeightsError naming the file. `xdit-lab run` on a corrupt folder exits 2 with one line.
"""

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch

from xdit_lab import ParallelConfig, load_pipeline
from xdit_lab.families import RECIPES
from xdit_lab.families.recipe import Request
from xdit_lab.safetensors_io import CorruptWeightsError
from xdit_lab.shard_loading import WeightsMismatchError
from xdit_lab.testing import run_cli, run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline, tiny_pipeline_kwargs

KWARGS = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


def _error(call):
    """(exception class name, message) of what `call()` raises; None when it runs."""
    try:
        call()
    except Exception as error:  # the tests check the class and the message
        return type(error).__name__, str(error)
    return None


# ---- call arguments ----------------------------------------------------------------------------------------


def _call_errors(folder):
    pipe = load_pipeline(folder, ParallelConfig(), progress=False)
    base = {k: v for k, v in KWARGS.items() if k not in ("height", "width")}

    def latent(*prompt, **arguments):
        return lambda: pipe(*prompt or ("a red cat",), output_type="latent", **{**KWARGS, **arguments})

    out = {
        "height 0": latent(height=0),
        "width 0": latent(width=0),
        "steps 0": latent(num_inference_steps=0),
        "negative sizes": latent(height=-16, width=-8),
        "float height": latent(height=16.0),
        "bool steps": latent(num_inference_steps=True),
        "empty list": latent([]),
        "not a string": latent(["a red cat", 5]),
        "no prompt": latent(None),
        "negative not a string": latent(negative_prompt=[None]),
        "generator and seed": latent(generator=torch.Generator().manual_seed(0), seed=0),
        "text seed": latent(seed="7"),
        "generators per prompt": latent(["a red cat", "a dog"], generator=[torch.Generator()] * 3),
        "text guidance": latent(guidance_scale="high"),
        "long prompt": latent("a red cat and a blue dog with a car"),
        "long negative": latent(negative_prompt="a red cat and a blue dog with a car"),
    }
    out = {name: _error(call) for name, call in out.items()}
    # the controls: the same calls with good values run, and None is the folder's default
    good = pipe("a red cat", seed=0, output_type="latent", **{**base, "height": 16, "width": 8})
    default = pipe("a red cat", seed=0, output_type="latent", **base)
    eight = pipe("a red cat and a blue dog", seed=0, output_type="latent", **KWARGS)  # 7 of 8 tokens
    out["controls"] = (tuple(good.images.shape), tuple(default.images.shape), tuple(eight.images.shape))
    pipe.close()
    return out


def test_call_arguments_are_checked(folder):
    out = run_on_ranks(_call_errors, 1, folder, timeout_s=240)[0]
    # latents at 16 × 8 px, at the folder's default 16 px (the VAE halves), and of a 7-token prompt at 16 px
    assert out.pop("controls") == ((1, 4, 8, 4), (1, 4, 8, 8), (1, 4, 8, 8))
    for name, error in out.items():
        assert error is not None, f"{name}: ran without an error"
        assert error[0] == "ValueError", (name, error)
    for name, argument, value in [
        ("height 0", "height", "0"),
        ("width 0", "width", "0"),
        ("steps 0", "num_inference_steps", "0"),
        ("negative sizes", "height", "-16"),
        ("float height", "height", "16.0"),
        ("bool steps", "num_inference_steps", "True"),
    ]:
        message = out[name][1]
        assert message.startswith(f"{argument} must be a whole number ≥ 1, or None for the model's default"), name
        assert message.endswith(f"got {value}"), (name, message)
    assert "None for the model's default, 20; got 0" in out["steps 0"][1]  # what 0 silently became
    assert "prompt is an empty list: give at least one string" in out["empty list"][1]
    assert "prompt[1] is int 5: every prompt must be a string" in out["not a string"][1]
    assert "prompt must be a string or a list of strings; got NoneType None" in out["no prompt"][1]
    assert "negative_prompt[0] is NoneType None" in out["negative not a string"][1]
    assert out["generator and seed"][1].startswith("pass generator= or seed=, not both")
    assert "seed must be a whole number" in out["text seed"][1] and "'7'" in out["text seed"][1]
    assert "3 generators for 2 prompts" in out["generators per prompt"][1]
    assert "guidance_scale must be a number" in out["text guidance"][1]
    long_prompt, long_negative = out["long prompt"][1], out["long negative"][1]
    assert long_prompt.startswith("prompt 0 is 11 tokens (T5Tokenizer), more than this call's max_sequence_length of 8")
    assert "Shorten it to 8 tokens, or pass max_sequence_length=11" in long_prompt
    assert long_negative.startswith("negative_prompt 0 is 11 tokens")


# ---- prompts longer than the text encoder reads: the boundary, against diffusers' own encode -------------


FAMILIES = {
    "pixart": "PixArtAlphaPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
    "cogvideox": "CogVideoXPipeline",
    "wan": "WanPipeline",
    "flux2": "Flux2Pipeline",
    "flux2 klein": "Flux2KleinPipeline",
    "qwenimage": "QwenImagePipeline",
    "hunyuanvideo": "HunyuanVideoPipeline",
    "zimage": "ZImagePipeline",
    "sana": "SanaPipeline",  # its default complex human instruction before the prompt
    "ltx2": "LTX2Pipeline",  # Gemma 3's every layer, through the connectors
}
# the prompt sits in a template whose closing tokens count: words this many past P are past them (klein's chat
# closes with its assistant's header and an empty thinking block, 13 tokens in the tiny tokenizer)
TEMPLATED = {"flux2": 8, "flux2 klein": 16, "qwenimage": 8, "hunyuanvideo": 8, "zimage": 8}
# HunyuanVideo's pooled CLIP embedding reads up to 77 tokens whatever max_sequence_length says (Llama's bound)
UNBOUNDED = {"hunyuanvideo": ("pooled_projections",)}


def _request(recipe, case, text):
    family = case.split()[0]  # "flux2 klein": the flux2 family's Flux2KleinPipeline
    options = {k: v for k, v in tiny_pipeline_kwargs(family).items() if k in recipe.options}
    if family == "qwenimage":
        # its default, 512, would make a long prompt to encode; the tiny tokenizer spells the template in more
        # tokens than the 34 the pipeline crops, so 48 leaves about 20 for the prompt
        options["max_sequence_length"] = 48
    return Request([text], None, 2, 1.0, None, None, 0, options=recipe.check_options(options))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_longest_prompt_accepted_is_the_longest_diffusers_reads_whole(family):
    """P is the longest prompt of "a"s (one token each in every tiny tokenizer) the check accepts, Q = P and one
    more "a". Reference: diffusers' encode_prompt, through the recipe's one call of it. Diffusers reads all of
    P (its last word, made "an", changes the embeddings) and cuts a longer prompt: the last word of Q (for the
    families with a template, of P and TEMPLATED's more, past the template's closing tokens) changes nothing."""
    pipe, recipe = tiny_pipeline(family.split()[0], pipeline_class=FAMILIES[family]), RECIPES[FAMILIES[family]]

    def accepted(text):
        try:
            recipe.check_prompt_lengths(pipe, _request(recipe, family, text))
        except ValueError:
            return False
        return True

    prompt = "a"
    while accepted(f"{prompt} a"):
        prompt = f"{prompt} a"
    longer = f"{prompt} a"
    limit = recipe.token_budget(pipe, _request(recipe, family, prompt))
    with pytest.raises(ValueError, match=rf"^prompt 0 is {limit + 1} tokens.*max_sequence_length of {limit}"):
        recipe.check_prompt_lengths(pipe, _request(recipe, family, longer))

    def encoded(text):
        with torch.no_grad():
            conditioning = recipe.encode_texts(pipe, _request(recipe, family, text), [text], "cpu", negative=False)
        return [
            value
            for key, value in conditioning.items()
            if isinstance(value, torch.Tensor) and key not in UNBOUNDED.get(family, ())
        ]

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(encoded(a), encoded(b)))

    assert len(prompt.split()) >= 3 and not same(prompt, prompt[:-1] + "an")  # P is read whole
    cut = longer if family not in TEMPLATED else prompt + " a" * TEMPLATED[family]
    assert same(cut, cut[:-1] + "an")  # what runs past the limit is dropped by diffusers


# ---- folders ------------------------------------------------------------------------------------------------


def _copy(folder, tmp, name):
    copy = Path(tmp) / name
    shutil.copytree(folder, copy)
    return copy


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _folder_errors(folder, tmp):
    folder, tmp = Path(folder), Path(tmp)
    cases = {"a file": folder / "model_index.json"}
    cases["missing component"] = _copy(folder, tmp, "missing")
    shutil.rmtree(cases["missing component"] / "text_encoder")
    cases["index not JSON"] = _copy(folder, tmp, "not-json")
    (cases["index not JSON"] / "model_index.json").write_text("{not json")
    cases["index a list"] = _copy(folder, tmp, "a-list")
    (cases["index a list"] / "model_index.json").write_text("[1, 2]")
    cases["index without class"] = _copy(folder, tmp, "no-class")
    _edit_json(cases["index without class"] / "model_index.json", lambda index: index.pop("_class_name"))
    cases["bad entry"] = _copy(folder, tmp, "bad-entry")
    _edit_json(cases["bad entry"] / "model_index.json", lambda index: index.update(vae=["diffusers"]))
    for name, component, key, change in [
        ("more layers", "transformer", "num_layers", 1),
        ("fewer layers", "transformer", "num_layers", -1),
        ("wider", "transformer", "attention_head_dim", 8),
        ("text encoder layers", "text_encoder", "num_layers", 1),
        ("vae layers", "vae", "layers_per_block", 1),
    ]:
        cases[name] = _copy(folder, tmp, name.replace(" ", "-"))
        _edit_json(
            cases[name] / component / "config.json", lambda c, key=key, change=change: c.update({key: c[key] + change})
        )
    out = {
        name: _error(lambda path=path: load_pipeline(path, ParallelConfig(), progress=False))
        for name, path in cases.items()
    }
    out["control"] = _error(lambda: load_pipeline(folder, ParallelConfig(), progress=False).close())
    # a configuration no mesh can be built from, and a folder that does not exist: the configuration is said first
    out["degrees"] = _error(lambda: load_pipeline(tmp / "no-such-model", ParallelConfig(cfg=3), progress=False))
    return out


def test_folder_errors(folder, tmp_path):
    out = run_on_ranks(_folder_errors, 1, str(folder), str(tmp_path), timeout_s=300)[0]
    assert out.pop("control") is None
    kind, message = out.pop("degrees")
    assert kind == "ParallelConfigError" and "cfg must be 1 or 2" in message, message
    assert "no-such-model" not in message
    assert out["a file"] == (
        "NotADirectoryError",
        f"{folder / 'model_index.json'} is a file, not a pipeline folder: pass the folder that holds model_index.json "
        f"({folder})",
    )
    kind, message = out["missing component"]
    assert kind == "FileNotFoundError" and "lacks component folder(s) its model_index.json lists: " in message
    assert "text_encoder/ (transformers.T5EncoderModel)" in message and "[null, null]" in message
    assert out["index not JSON"][0] == "ValueError" and "model_index.json is not valid JSON" in out["index not JSON"][1]
    for name, said in [("index a list", "it holds [1, 2]"), ("index without class", 'it has no "_class_name"')]:
        assert out[name][0] == "ValueError" and "is not a diffusers pipeline index" in out[name][1], name
        assert said in out[name][1], name
    assert "vae: ['diffusers']" in out["bad entry"][1] and "[library, class] pairs" in out["bad entry"][1]
    for name, component, cls, said in [
        ("more layers", "transformer", "PixArtTransformer2DModel", "parameter(s) of the module are in no file"),
        ("fewer layers", "transformer", "PixArtTransformer2DModel", "tensor(s) in the files have no place"),
        ("wider", "transformer", "PixArtTransformer2DModel", "tensor(s) differ in shape"),
        ("text encoder layers", "text_encoder", "T5EncoderModel", "parameter(s) of the module are in no file"),
        ("vae layers", "vae", "AutoencoderKL", "parameter(s) of the module are in no file"),
    ]:
        kind, message = out[name]
        assert kind == WeightsMismatchError.__name__, (name, kind, message)
        assert f"{name.replace(' ', '-')}/{component}/config.json does not match the weights beside it" in message
        assert f"the {cls} it builds" in message and said in message, (name, message)
        assert message.endswith("Copy the config.json saved with these weights (or the weights saved with this config)")
    assert "transformer_blocks.2." in out["more layers"][1] and "transformer_blocks.1." in out["fewer layers"][1]


def _corrupt(path: Path, how: str) -> None:
    """A real file broken as a failed copy or a bad save breaks it."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    if how == "short":  # cut inside the 8-byte length
        path.write_bytes(data[:5])
    elif how == "header overrun":  # the length claims more than the file holds
        path.write_bytes(struct.pack("<Q", len(data)) + data[8:])
    elif how == "truncated":  # cut inside the tensors
        path.write_bytes(data[:-100])
    elif how == "header not JSON":
        path.write_bytes(data[:8] + b"{" * header_len + data[8 + header_len :])
    elif how == "header not tensors":  # valid JSON, not a table of tensors
        text = json.dumps({"w": {"dtype": "F32", "shape": "four"}}).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text)


CORRUPTIONS = ("short", "header overrun", "truncated", "header not JSON", "header not tensors")


def _corrupt_loads(tmp, config):
    """On each rank: load_pipeline under `config` of folders whose transformer file is corrupt in each way, and
    the stage loader or the sharded loader on its own (what load_pipeline's memory plan reads first)."""
    from xdit_lab.loading import load_sharded_transformer, load_stage_transformer
    from xdit_lab.mesh import RankMesh

    out = {}
    for how in CORRUPTIONS:
        copy = Path(tmp) / how.replace(" ", "-")
        shard = config.world_size > 1
        out[how] = _error(
            lambda copy=copy, shard=shard: load_pipeline(copy, config, progress=False, shard_weights=shard)
        )
        if config.pipefusion > 1:
            out[f"stage loader, {how}"] = _error(
                lambda copy=copy: load_stage_transformer(
                    copy / "transformer", "PixArtTransformer2DModel", (0, 1), torch.float32, "cpu"
                )
            )
        elif shard:
            mesh = RankMesh(config)
            out[f"sharded loader, {how}"] = _error(
                lambda copy=copy, mesh=mesh: load_sharded_transformer(
                    copy / "transformer", "PixArtTransformer2DModel", config, mesh, torch.float32, "cpu"
                )
            )
            mesh.close()
    return out


@pytest.mark.parametrize("config", [ParallelConfig(), ParallelConfig(pipefusion=2), ParallelConfig(ulysses=2)])
def test_corrupt_weights_are_named_by_every_loader(folder, tmp_path, config):
    """Serial; PipeFusion 2 (its stage loader reads only its blocks); ulysses 2 with shard_weights=True (the
    sharded loader reads only its rows): each corruption is a CorruptWeightsError naming the file."""
    for how in CORRUPTIONS:
        _corrupt(
            _copy(folder, tmp_path, how.replace(" ", "-")) / "transformer" / "diffusion_pytorch_model.safetensors", how
        )
    for rank, out in enumerate(run_on_ranks(_corrupt_loads, config.world_size, str(tmp_path), config)):
        assert len(out) == len(CORRUPTIONS) * (1 if config.world_size == 1 else 2)
        for case, error in out.items():
            assert error is not None and error[0] == CorruptWeightsError.__name__, (rank, case, error)
            how = case.split(", ")[-1].replace(" ", "-")
            assert f"{how}/transformer/diffusion_pytorch_model.safetensors" in error[1], (case, error)
            assert "save or copy it again" in error[1], (case, error)


def test_cli_exits_2_with_one_line_on_corrupt_weights(folder, tmp_path):
    """`xdit-lab run` on a folder whose transformer file is corrupt, in a plain process (a world of one, run_cli's):
    exit 2 with one line naming the file, nothing written."""
    corrupt = _copy(folder, tmp_path, "corrupt")
    _corrupt(corrupt / "transformer" / "diffusion_pytorch_model.safetensors", "header overrun")
    job = run_cli(
        ["run", "--model", str(corrupt), "--prompt", "a red cat", "--output", str(tmp_path / "out"), "--no-progress"],
        torchrun=False,
        env={"RANK": "0", "WORLD_SIZE": "1"},
        timeout_s=180,
    )
    lines = job.stderr.strip().splitlines()
    assert job.codes == [2], job
    assert len(lines) == 1 and "Traceback" not in job.stderr, job
    assert lines[0].startswith(f"xdit-lab run: error: {corrupt}/transformer/diffusion_pytorch_model.safetensors")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ---- a step-distilled Flux.2 klein folder: one branch, as its model_index.json says ------------------------------


def _distilled_klein_errors(distilled, corrupt, base):
    """On each rank: cfg 2 on the step-distilled folder whose transformer file is cut short (never opened: the index
    says it first), cfg 1 on it (control: the short file is met), a negative prompt on the distilled model, and the
    base model's folder under cfg 2 with one (control: two branches to split)."""
    from xdit_lab import RankMesh

    kwargs = dict(tiny_pipeline_kwargs("flux2"), num_inference_steps=1, output_type="latent")
    out = dict(
        cfg_2=_error(lambda: load_pipeline(corrupt, ParallelConfig(cfg=2), progress=False)),
        cfg_1=_error(lambda: load_pipeline(corrupt, ParallelConfig(dp=2), progress=False)),
    )
    pipe = load_pipeline(distilled, ParallelConfig(dp=2), mesh=RankMesh(ParallelConfig(dp=2)), progress=False)
    out["negative"] = _error(lambda: pipe(["a red cat"] * 2, negative_prompt="a photo", **kwargs))
    out["distilled"] = _error(lambda: pipe(["a red cat"] * 2, guidance_scale=4.0, **kwargs))  # ignored, as diffusers
    pipe.close()
    pipe = load_pipeline(base, ParallelConfig(cfg=2), mesh=RankMesh(ParallelConfig(cfg=2)), progress=False)
    out["base"] = _error(lambda: pipe("a red cat", negative_prompt="a photo", guidance_scale=2.0, **kwargs))
    pipe.close()
    return out


def test_cfg_2_on_a_step_distilled_klein_folder_is_refused_before_a_weight_is_read(tmp_path):
    """Flux2KleinPipeline runs a folder whose model_index.json says is_distilled on one branch, its guidance_scale
    ignored: cfg 2 is refused at load by that setting, naming what runs instead, before a weight is read (the
    transformer's file, cut short, is never opened); a negative prompt is refused at the call. The base model's
    folder (is_distilled false) runs both."""
    klein = dict(pipeline_class="Flux2KleinPipeline")
    distilled = save_tiny_pipeline("flux2", tmp_path / "distilled", is_distilled=True, **klein)
    base = save_tiny_pipeline("flux2", tmp_path / "base", is_distilled=False, **klein)
    corrupt = _copy(distilled, tmp_path, "corrupt")
    _corrupt(corrupt / "transformer" / "diffusion_pytorch_model.safetensors", "short")
    for out in run_on_ranks(_distilled_klein_errors, 2, str(distilled), str(corrupt), str(base), timeout_s=300):
        kind, message = out["cfg_2"]
        assert kind == "ParallelConfigError", out["cfg_2"]
        assert "step-distilled (is_distilled: true in its model_index.json)" in message, message
        assert "Use cfg 1 (dp 2 splits the prompts over 2 ranks)" in message and "base model" in message, message
        assert out["cfg_1"][0] == CorruptWeightsError.__name__, out["cfg_1"]
        kind, message = out["negative"]
        assert kind == "ValueError" and "drop negative_prompt" in message and "is_distilled: true" in message, message
        assert out["distilled"] is None and out["base"] is None, (out["distilled"], out["base"])
    # Flux.2 [dev]'s folder holds a Mistral 3 text encoder, klein's a Qwen3: neither runs as the other's pipeline
    dev = save_tiny_pipeline("flux2", tmp_path / "dev")
    for folder, asked, runs in [
        (dev, "Flux2KleinPipeline", "Flux2Pipeline"),
        (base, "Flux2Pipeline", klein["pipeline_class"]),
    ]:
        kind, message = _error(lambda folder=folder, asked=asked: load_pipeline(folder, pipeline_class=asked))
        assert kind == "ValueError" and message.startswith(f"pipeline_class={asked!r} runs other components than")
        assert message.endswith(f"(another flux2 pipeline); name one of {runs}"), message


# ---- HunyuanVideo-1.5: its guider, and the image its two pipelines take or do not ----------------------------


def test_hunyuanvideo15_refuses_what_its_pipelines_do_not_run():
    """A guider other than the plain ClassifierFreeGuidance (a rescale, a step window) is refused by name with
    the guider that runs; text to video refuses an image, image to video needs one and takes no height or width
    (it draws at the image's bucket). Control: the plain guider and the right image pass."""
    from diffusers import ClassifierFreeGuidance
    from PIL import Image

    text, video = (
        tiny_pipeline("hunyuanvideo15", pipeline_class=name)
        for name in ("HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline")
    )
    recipe, image = RECIPES["HunyuanVideo15Pipeline"], Image.new("RGB", (64, 64))

    def request(height=None, **options):
        return Request(["a red cat"], None, 2, 6.0, height, None, 0, options=recipe.check_options(options))

    assert _error(lambda: recipe.check_pipeline(text)) is None  # the control: the tiny folder's plain guider
    assert _error(lambda: recipe.check_inputs(text, request())) is None
    assert _error(lambda: recipe.check_inputs(video, request(image=image))) is None
    text.guider = ClassifierFreeGuidance(guidance_scale=6.0, guidance_rescale=0.7)
    kind, message = _error(lambda: recipe.check_pipeline(text))
    assert kind == "ValueError" and "guider is ClassifierFreeGuidance with {'guidance_rescale': 0.7}" in message
    assert "set pipe.guider = ClassifierFreeGuidance(guidance_scale=...)" in message
    kind, message = _error(lambda: recipe.check_inputs(text, request(image=image)))
    assert message.startswith("HunyuanVideo15Pipeline draws from text alone and takes no image")
    kind, message = _error(lambda: recipe.check_inputs(video, request()))
    assert message == "HunyuanVideo15ImageToVideoPipeline draws a video from an image: give image= (a PIL image)"
    kind, message = _error(lambda: recipe.check_inputs(video, request(height=64, image=image)))
    assert "draws at the image's size bucket" in message and "takes no height or width" in message


def test_hunyuanvideo15_refuses_a_prompt_its_pipeline_would_cut():
    """HunyuanVideo15Pipeline reads 1000 Qwen tokens past its chat template's opening and 256 ByT5 tokens of the quoted
    text, and takes no max_sequence_length. P is the longest prompt of "a"s the check accepts: diffusers' encode reads
    all of it (its last word made "an" changes the states) and cuts a longer one (a word past the template's closing
    tokens changes nothing); P and one more "a" is refused by name, as is quoted text of more than 256 tokens.
    Control: a short prompt with short quoted text passes."""
    pipe, recipe = tiny_pipeline("hunyuanvideo15"), RECIPES["HunyuanVideo15Pipeline"]

    def check(text):
        return _error(lambda: recipe.check_prompt_lengths(pipe, Request([text], None, 2, 6.0, None, None, 0, {})))

    assert check('a red cat and a sign that says "open"') is None
    words = 1
    while check(" ".join(["a"] * (words + 1))) is None:
        words += 100 if check(" ".join(["a"] * (words + 100))) is None else 1
    prompt = " ".join(["a"] * words)
    kind, message = check(prompt + " a")
    assert kind == "ValueError" and message.startswith("prompt 0 is 1001 tokens (Qwen2Tokenizer, past the chat")
    assert "more than the 1000 HunyuanVideo15Pipeline reads" in message and "Shorten it to 1000 tokens" in message

    def encoded(text):
        with torch.no_grad():
            return pipe.encode_prompt(prompt=[text], device="cpu")[0]

    assert not torch.equal(encoded(prompt), encoded(prompt[:-1] + "an"))  # P is read whole
    past = prompt + " a" * 8  # past the template's closing tokens: cut
    assert torch.equal(encoded(past), encoded(past[:-1] + "an"))
    kind, message = check('a sign that says "' + "x" * 300 + '"')
    assert message.startswith("prompt 0's quoted text is 310 tokens (ByT5Tokenizer") and "more than the 256" in message


def test_wan_refuses_a_frame_count_its_vae_does_not_decode():
    """WanPipeline.__call__ rounds num_frames to 4k + 1 with a warning in its log, but its prepare_latents (which the
    recipe calls) does not: 80 frames would give 20 latent frames where diffusers' pipeline draws 21. Refused by
    name with the counts that fit; control: 5 and 81 pass."""
    pipe, recipe = tiny_pipeline("wan"), RECIPES["WanPipeline"]

    def request(frames):
        call = {k: v for k, v in tiny_pipeline_kwargs("wan").items() if k not in ("height", "width")}
        options = recipe.check_options(dict(call, num_frames=frames))
        return Request(["a red cat"], None, 2, 5.0, 64, 64, 0, options=options)

    assert _error(lambda: recipe.check_inputs(pipe, request(5))) is None
    assert _error(lambda: recipe.check_inputs(pipe, request(81))) is None
    kind, message = _error(lambda: recipe.check_inputs(pipe, request(80)))
    assert kind == "ValueError" and message.startswith("num_frames 80: Wan's VAE decodes 4k + 1 frames")
    assert "give 77 or 81" in message and "round it to 81" in message
    assert "give 1 or 5" in _error(lambda: recipe.check_inputs(pipe, request(6)))[1]
