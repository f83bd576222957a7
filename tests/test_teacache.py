"""StepCache(method="teacache") on each family that offers it (tiny Flux, Flux.2, Wan and Wan 2.2's timestep per
token, HunyuanVideo and its token replace, Qwen-Image, CogVideoX, PixArt) under ulysses 2, ring 2 and dp 2, against
TeaCache's rule written here over diffusers' stock transformer run serially.

The reference (_by_hand) is hooks on the stock blocks: before the first block, the relative L1 change of its
timestep-modulated input (written out per family below from diffusers' block code, not from the adapters) against
the previous call's, rescaled by the polynomial and accumulated; below the threshold every block hands its input
on and the last block's image output becomes the first block's image input plus what the stack added at the last
full call; the first and the last call always run. At threshold 0 nothing skips and every strategy equals the model
without a cache; at a threshold that skips, every strategy skips the calls the rule skips and equals its outputs
(1e-4). The control, each dp rank deciding from its own rows' sums (Controls(cache_agrees=False)), takes other
decisions. Every call after the first all-reduces two float32 tagged "cache", and each call's bytes equal
traffic.py's closed form. Through load_pipeline and a session under ulysses 2 (Wan: and cfg 2), the latents equal
diffusers' FluxPipeline and WanPipeline (true CFG: two calls a step) run serially with the same hooks (at 0:
without), and the session forces the last step's run, as the rule does."""

import inspect
from dataclasses import dataclass

import pytest
import torch
from diffusers.models.transformers.transformer_flux2 import Flux2Modulation
from forward_traffic import forward_shapes, moved, session_traffic, traffic_mismatches

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, StepCache, comm_log, load_pipeline, parallelize
from xdit_lab.models import Controls, parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer
from xdit_lab.traffic import expected_bytes_per_step

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 6
COEFFICIENTS = (2.0, 0.5, 0.0)  # a rescale that is not the identity, never negative on [0, inf)
CONFIGS = [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)]


def _wan_modulated(block, a):
    """WanTransformerBlock.forward's first lines: norm1(x) × (1 + scale_msa) + shift_msa, of temb [B, 6, D] or, with a
    timestep per token (Wan 2.2 TI2V), [B, S, 6, D]."""
    temb = a["temb"]
    if temb.ndim == 4:
        shift, scale = (block.scale_shift_table.unsqueeze(0) + temb.float()).chunk(6, dim=2)[:2]
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (block.scale_shift_table + temb.float()).chunk(6, dim=1)[:2]
    return (block.norm1(a["hidden_states"].float()) * (1 + scale) + shift).type_as(a["hidden_states"])


def _norm1_zero(block, a):
    """AdaLayerNormZero's first output: norm1(x, emb=temb)'s normed, shifted and scaled states."""
    return block.norm1(a["hidden_states"], emb=a["temb"])[0]


def _qwen_modulated(block, a):
    """QwenImageTransformerBlock.forward: img_norm1(x) modulated by the shift and scale of img_mod(temb)'s first
    half."""
    shift, scale = block.img_mod(a["temb"]).chunk(2, dim=-1)[0].chunk(3, dim=-1)[:2]
    return block.img_norm1(a["hidden_states"]) * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _cogvideox_modulated(block, a):
    """CogVideoXLayerNormZero's image part: norm(x) × (1 + scale) + shift, the first two of linear(silu(temb))."""
    shift, scale = block.norm1.linear(block.norm1.silu(a["temb"])).chunk(6, dim=1)[:2]
    return block.norm1.norm(a["hidden_states"]) * (1 + scale)[:, None, :] + shift[:, None, :]


def _token_replace_modulated(block, a):
    """HunyuanVideoTokenReplaceAdaLayerNormZero: the first num_tokens tokens (the first frame's, this rank's share)
    shifted and scaled by token_replace_emb's modulation (t = 0), the others by temb's."""
    norm, n, x = block.norm1, a["num_tokens"], block.norm1.norm(a["hidden_states"])
    shift, scale = norm.linear(norm.silu(a["temb"])).chunk(6, dim=1)[:2]
    first_shift, first_scale = norm.linear(norm.silu(a["token_replace_emb"])).chunk(6, dim=1)[:2]
    first = x[:, :n] * (1 + first_scale[:, None]) + first_shift[:, None]
    return torch.cat([first, x[:, n:] * (1 + scale[:, None]) + shift[:, None]], dim=1)


def _flux2_modulated(block, a):
    """Flux2TransformerBlock.forward: (1 + scale_msa) × norm1(x) + shift_msa, Flux2Modulation.split's first set."""
    (shift, scale, _), _ = Flux2Modulation.split(a["temb_mod_img"], 2)
    return (1 + scale) * block.norm1(a["hidden_states"]) + shift


def _pixart_modulated(block, a):
    """BasicTransformerBlock.forward, norm_type ada_norm_single: norm1(x) × (1 + scale_msa) + shift_msa."""
    batch = a["hidden_states"].shape[0]
    shift, scale = (block.scale_shift_table[None] + a["timestep"].reshape(batch, 6, -1)).chunk(6, dim=1)[:2]
    return block.norm1(a["hidden_states"]) * (1 + scale) + shift


@dataclass(frozen=True)
class Family:
    """What the rule needs of a family's stock model, read from diffusers' block code: its block lists in order, the
    first block's modulated input from its forward's arguments, where a block that returns a pair returns its
    image states (one that returns a tensor returns the image, or [text; image] joined), and a threshold at
    which the tiny model's calls skip some and run some (each family's rescaled changes like Flux's below; its
    text as long as the tiny model's positional table where it has one)."""

    block_lists: tuple
    modulated: object
    image_at: int | None
    threshold: float
    text_len: int = 6
    family: str = ""  # the tiny model's family where the key names a variant of it (its transformer's `overrides`)
    overrides: tuple = ()
    timestep_per_token: bool = False  # Wan 2.2 TI2V's [B, S]: 0 on the first latent frame's tokens, t on the others


FAMILIES = dict(
    flux=Family(
        ("transformer_blocks", "single_transformer_blocks"),
        _norm1_zero,
        image_at=1,
        # rescaled changes about 0.056, 0.053, 0.048, 0.042 (whole batch): accumulated, 0.109 at the third call
        # crosses 0.1 (run), 0.090 at the fifth does not (skip); each rank's own rows alone (the control) give about
        # 0.010 and 0.119 a call, which skip every call and run the second
        threshold=0.1,
    ),
    wan=Family(("blocks",), _wan_modulated, image_at=None, threshold=0.1),
    wan_timestep_per_token=Family(
        ("blocks",), _wan_modulated, image_at=None, threshold=0.1, family="wan", timestep_per_token=True
    ),
    flux2=Family(("transformer_blocks", "single_transformer_blocks"), _flux2_modulated, image_at=1, threshold=0.1),
    pixart=Family(("transformer_blocks",), _pixart_modulated, image_at=None, threshold=0.1),
    hunyuanvideo=Family(("transformer_blocks", "single_transformer_blocks"), _norm1_zero, image_at=0, threshold=0.1),
    hunyuanvideo_token_replace=Family(  # HunyuanVideo-I2V's: frame 0 modulated at t = 0
        ("transformer_blocks", "single_transformer_blocks"),
        _token_replace_modulated,
        image_at=0,
        threshold=0.1,
        family="hunyuanvideo",
        overrides=(("image_condition_type", "token_replace"),),
    ),
    qwenimage=Family(("transformer_blocks",), _qwen_modulated, image_at=1, threshold=0.1),
    cogvideox=Family(("transformer_blocks",), _cogvideox_modulated, image_at=0, threshold=0.1, text_len=8),
)


def _family(key):
    return FAMILIES[key].family or key


def _model(key):
    return tiny_transformer(_family(key), layers=4, **dict(FAMILIES[key].overrides))


def _calls(family):
    """Six transformer calls on a slowly changing latent, each batch row at its own pace (so a dp rank's own
    rows measure another change than the whole batch)."""
    base = tiny_inputs(_family(family), 2, height=8, width=8, text_len=FAMILIES[family].text_len)
    latents = base["hidden_states"]
    if FAMILIES[family].timestep_per_token:  # [B, F, H / 2, W / 2] tokens (Wan's 1 × 2 × 2 patches), frame-major
        per_token = (
            base["timestep"].view(2, 1, 1, 1).expand(2, *latents.shape[2:3], *[n // 2 for n in latents.shape[3:]])
        )
        base["timestep"] = torch.cat([torch.zeros_like(per_token[:, :1]), per_token[:, 1:]], dim=1).flatten(1)
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(3))
    pace = torch.tensor([0.02, 0.15]).view(2, *[1] * (latents.ndim - 1))
    return [dict(base, hidden_states=latents + pace * i * noise) for i in range(STEPS)]


def _by_hand(model, family, threshold, coefficients, steps=STEPS, calls_per_step=1):
    """TeaCache's rule on the serial model by hooks on its stock blocks; returns the list of skips, one per call.
    With calls_per_step 2 (diffusers' WanPipeline calls the transformer for the text, then without it, at each
    step) each of the step's calls keeps its own previous input, sum and cache, as TeaCache's Wan code does."""
    spec = FAMILIES[family]
    blocks = [block for name in spec.block_lists for block in getattr(model, name)]
    memos, skips = [dict(previous=None, accumulated=0.0) for _ in range(calls_per_step)], []

    def arguments(block, args, kwargs):
        bound = inspect.signature(block.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments

    def before_first(block, args, kwargs):
        a = arguments(block, args, kwargs)
        memo, step = memos[len(skips) % calls_per_step], len(skips) // calls_per_step
        modulated = spec.modulated(block, a)
        previous = memo["previous"]
        memo["previous"] = modulated
        skip = False
        if previous is not None and step < steps - 1:
            x = ((modulated - previous).abs().mean() / previous.abs().mean()).item()
            memo["accumulated"] += sum(c * x ** (len(coefficients) - 1 - i) for i, c in enumerate(coefficients))
            skip = memo["accumulated"] < threshold
        if not skip:
            memo["accumulated"] = 0.0
        skips.append(skip)
        memo["image_in"] = a["hidden_states"]

    def after(block, args, kwargs, output):
        memo, last = memos[(len(skips) - 1) % calls_per_step], block is blocks[-1]
        image_in = memo["image_in"]
        tokens = image_in.shape[1]  # a block returning one tensor returns the image's tokens last ([text; image])
        if not skips[-1]:
            if last:
                image_out = output[:, -tokens:] if torch.is_tensor(output) else output[spec.image_at]
                memo["added"] = image_out - image_in
            return None
        a = arguments(block, args, kwargs)
        hidden = a["hidden_states"]  # a skipped block hands its input on ...
        if last:  # ... the last, the image as the first block took it plus what the stack added at the last full call
            hidden = torch.cat([hidden[:, : hidden.shape[1] - tokens], image_in + memo["added"]], dim=1)
        if torch.is_tensor(output):
            return hidden
        passed = [a["encoder_hidden_states"], a["encoder_hidden_states"]]  # the text as it came
        passed[spec.image_at] = hidden
        return tuple(passed)

    blocks[0].register_forward_pre_hook(before_first, with_kwargs=True)
    for block in blocks:
        block.register_forward_hook(after, with_kwargs=True)
    return skips


def _runs(family, configs, threshold, controls=None):
    calls = _calls(family)
    reference = _model(family)
    expected_skips = _by_hand(reference, family, threshold, COEFFICIENTS)
    with torch.no_grad():
        expected = [reference(**x).sample for x in calls]
    rows = []
    for config in configs:
        model = _model(family)
        settings = StepCache(threshold, method="teacache", coefficients=COEFFICIENTS)
        model = parallelize(model, config, RankMesh(config), cache=settings, controls=controls)
        cache = parallel_state(model).cache
        outs, traffic, agreed = [], [], []
        with torch.no_grad():
            for step, x in enumerate(calls):
                cache.final = step == STEPS - 1  # as a session sets it before its last step
                with comm_log() as log:
                    outs.append(model(**x).sample)
                state = parallel_state(model)
                closed = expected_bytes_per_step(
                    config,
                    forward_shapes(model, x),
                    coords=dict(state.mesh.coords),
                    step=step,
                    cache_skips=list(cache.skips),
                    cache_method="StepCache(teacache)",
                )
                traffic.append(dict(moved=moved(log), expected=closed))
                agreed.append(sum(r.tag == "cache" for r in log))
        rows.append(
            dict(
                config=config.short(),
                error=max((o - e).abs().max().item() for o, e in zip(outs, expected)),
                skips=list(cache.skips),
                changes=list(cache.changes),
                traffic=traffic,
                agreed=agreed,
            )
        )
    largest = max(e.abs().max().item() for e in expected)
    return dict(rows=rows, largest=largest, expected_skips=expected_skips)


def _check(family, per_rank, skipping):
    for rank, out in enumerate(per_rank):
        assert any(out["expected_skips"]) == skipping, out["expected_skips"]
        assert not out["expected_skips"][0] and not out["expected_skips"][-1]
        for index, row in enumerate(out["rows"]):
            where = f"{family} {row['config']} rank {rank}"
            assert row["error"] <= 1e-4 * max(1.0, out["largest"]), f"{where}: {row['error']:.3g}"
            assert row["skips"] == out["expected_skips"], (where, row["changes"])
            assert row["skips"] == per_rank[0]["rows"][index]["skips"], f"{where}: ranks disagree"
            assert row["agreed"] == [0] + [1] * (STEPS - 1), where  # one all-reduce per decision, tag "cache"
            assert not traffic_mismatches(row["traffic"], where), traffic_mismatches(row["traffic"], where)


@pytest.mark.parametrize("family", FAMILIES)
def test_threshold_zero_equals_the_model_without_a_cache(family):
    _check(family, run_on_ranks(_runs, 2, family, CONFIGS, 0.0, timeout_s=300), skipping=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_strategy_equals_teacache_by_hand_and_the_per_rank_control_differs(family):
    threshold = FAMILIES[family].threshold
    _check(family, run_on_ranks(_runs, 2, family, CONFIGS, threshold, timeout_s=300), skipping=True)
    control = run_on_ranks(_runs, 2, family, [ParallelConfig(dp=2)], threshold, Controls(cache_agrees=False))
    for out in control:
        row = out["rows"][0]
        assert row["skips"] != out["expected_skips"], row
        assert row["error"] > 1e-4 * max(1.0, out["largest"]), row


def test_refused_where_not_built():
    teacache = StepCache(0.1, method="teacache")
    with pytest.raises(ParallelConfigError, match="teacache.*not offered on sd3"):
        parallelize(tiny_transformer("sd3", layers=2), ParallelConfig(), cache=teacache)
    with pytest.raises(ParallelConfigError, match="teacache.*PipeFusion"):
        parallelize(tiny_transformer("flux", layers=4), ParallelConfig(pipefusion=2), cache=teacache)
    with pytest.raises(ParallelConfigError, match="compile=True does not take StepCache.method='teacache'"):
        parallelize(tiny_transformer("flux", layers=4), ParallelConfig(), cache=teacache, compile=True)
    with pytest.raises(ValueError, match="coefficients"):
        StepCache(0.1, coefficients=(1.0, 0.0))


def _pipeline_runs(folder, family, config, threshold, expected):
    """On every rank: load_pipeline under `config` with the TeaCache, one session: (error, skips, traffic, method)."""
    from xdit_lab.lab.summaries import rank_summary

    settings = StepCache(threshold, method="teacache", coefficients=COEFFICIENTS)
    pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, cache=settings)
    session = pipe.session(PROMPTS, seed=0, **_call_kwargs(family)).run()
    latents = _latents(session.result(output_type="latent"))
    out = dict(
        error=(latents - expected).abs().max().item(),
        bound=1e-4 * max(1.0, expected.abs().max().item()),
        skips=list(session.cache_skips),
        traffic=session_traffic(session),
        method=rank_summary(session)["cache"]["method"],
    )
    pipe.close()
    return out


PROMPTS = ["a red cat", "a blue dog"]


def _call_kwargs(family):
    """Wan's pipeline runs true CFG (guidance 5): diffusers calls the transformer twice a step, the session once on
    [uncond; cond]."""
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=STEPS)
    return dict(kwargs, guidance_scale=5.0, negative_prompt=["", "a photo"]) if family == "wan" else kwargs


def _latents(output):
    return output.frames if hasattr(output, "frames") else output.images


# Flux's rescaled changes are about 0.059, 0.063, 0.071, 0.072, 0.075 (serial): at 0.15 the calls skip, skip, run
# (0.193), skip, and the last runs though 0.147 would skip it (a session tells the cache its last step). Wan's, the
# same for both branches, about 0.043, 0.058, 0.081, 0.105, 0.195: skip, skip (0.100), run (0.181), skip, and the last
PIPELINE_SKIPS = [False, True, True, False, True, False]


@pytest.mark.parametrize(
    "family, config, threshold",
    [
        ("flux", ParallelConfig(ulysses=2), 0.0),
        ("flux", ParallelConfig(ulysses=2), 0.15),
        ("wan", ParallelConfig(ulysses=2), 0.0),
        ("wan", ParallelConfig(ulysses=2), 0.15),
        ("wan", ParallelConfig(cfg=2), 0.15),  # uncond on one rank, cond on the other: one decision still
    ],
    ids=lambda value: value.short() if isinstance(value, ParallelConfig) else None,
)
def test_a_session_equals_diffusers_pipeline_with_the_rule(tmp_path, family, config, threshold):
    """Through load_pipeline and a session (which tells the cache its last step): ulysses 2 (and Wan's cfg 2) equals
    diffusers' pipeline run serially, without a cache at 0, with the rule's hooks on its transformer above; the
    session's steps moved what the closed form says of a TeaCache's skips.

    Wan under CFG: diffusers' WanPipeline calls the transformer with the text, then without it, and TeaCache's
    Wan code keeps a previous input, a sum and a cache for each of the two (the by-hand rule here does the
    same); the session calls it once on [uncond; cond] and takes one decision from the sums over both halves.
    The two agree: Wan's modulated input is the patch embedding of the latents, normed and modulated by the
    timestep alone (the text enters by cross-attention, after it), so both halves' inputs and changes are the
    same and so are both branches' decisions. (A family whose temb reads the text, Flux's pooled projection,
    would weigh its halves' changes by their sizes; Flux's session here runs without true CFG.)"""
    from diffusers import DiffusionPipeline

    folder = save_tiny_pipeline(family, tmp_path)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    per_step = 2 if family == "wan" else 1
    by_hand = _by_hand(reference.transformer, family, threshold, COEFFICIENTS, calls_per_step=per_step)
    with torch.no_grad():
        output = reference(
            PROMPTS, generator=torch.Generator().manual_seed(0), **_call_kwargs(family), output_type="latent"
        )
    expected_skips = by_hand[::per_step]
    assert by_hand[per_step - 1 :: per_step] == expected_skips, by_hand  # Wan: both branches decide alike
    assert expected_skips == (PIPELINE_SKIPS if threshold else [False] * STEPS), expected_skips
    for rank, out in enumerate(run_on_ranks(_pipeline_runs, 2, folder, family, config, threshold, _latents(output))):
        where = f"{family} {config.short()} rank {rank}"
        assert out["error"] <= out["bound"], f"{where}: {out['error']:.3g} > {out['bound']:.3g}"
        assert out["skips"] == expected_skips, where
        assert out["method"] == "StepCache(teacache)", where
        assert not traffic_mismatches(out["traffic"], where), traffic_mismatches(out["traffic"], where)


def test_the_cli_and_the_load_record_name_it():
    from xdit_lab.cli import _cache
    from xdit_lab.load_options import LoadOptions

    settings = _cache("teacache:threshold=0.15,coefficients=[2.0,0.5,0.0]")
    assert settings == StepCache(0.15, method="teacache", coefficients=COEFFICIENTS)
    record = LoadOptions(cache=settings).to_record()["cache"]
    assert record == {"threshold": 0.15, "method": "teacache", "coefficients": [2.0, 0.5, 0.0]}
    assert LoadOptions(cache=StepCache(0.2)).to_record()["cache"] == {"threshold": 0.2, "method": "first_block"}
