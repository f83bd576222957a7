"""One planner (issue 56): what a load plans for each component's weights is the row `xdit-lab plan --model` prints
for the same configuration and placement, and it is what each rank holds once loaded.

    every tiny family's pipeline folder (and Wan 2.1 I2V's, whose CLIP image encoder is no text encoder)
      × whole | sharded (shard_weights) | text encoders on the host | int8 | a PipeFusion stage
        the load's plan    pipe.memory_plan.per_rank_bytes, per component
      = the planner's row  plan_model(folder, 2, ...)'s row for that config and placement, its weights
      = what is held       the busiest rank's parameters and saved buffers per component, measured after loading
                           (a text encoder kept in host memory holds nothing on the device)
      and the load's weight gathers, stale K/V and decode peak are the row's gather, stale_kv and decode_peak
      (the load plans one prompt at the call defaults, a negative prompt counted as given)

A combination the load refuses is one the planner has no row for, and the other way round.

Every load of every folder runs in one pair of forked ranks (xdit_lab.testing.run_on_ranks): no fresh
interpreter per case."""

import json

import pytest
import torch

from xdit_lab import ParallelConfig
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import PIPELINES, save_tiny_pipeline, tiny_pipeline_kwargs, tiny_wan_2_1_image_to_video

WORLD = 2
PLENTY = 10**12  # bytes of "GPU" memory: every row fits, so none is dropped for size
# case -> (config, load_pipeline's keywords, the planner's row: shard_weights, text encoders, quantize)
CASES = {
    "whole": (ParallelConfig(ulysses=2), {}, (False, "gpu", None)),
    "sharded": (ParallelConfig(ulysses=2), {"shard_weights": True}, (True, "sharded", None)),
    "host": (ParallelConfig(ulysses=2), {"on_host": "text encoders"}, (False, "host", None)),
    "int8": (ParallelConfig(ulysses=2), {"quantization": "int8"}, (False, "gpu", "int8")),
    "pipefusion": (ParallelConfig(pipefusion=2), {}, (False, "gpu", None)),
}
FOLDERS = [*PIPELINES, "wan_2_1_i2v"]
# (shard_weights, the text encoders' placement) load_pipeline can make: shard_weights shards the transformer and every
# text encoder not kept on the host
LOADABLE = {(False, "gpu"), (True, "sharded"), (False, "host"), (True, "host")}


def _save_wan_2_1_i2v(path):
    """Wan 2.1 I2V's layout: a CLIP vision tower as image_encoder beside the text encoder."""
    tiny_wan_2_1_image_to_video().save_pretrained(path, safe_serialization=True)
    return path


def _load_every_case(folders: dict) -> dict:
    """On this rank: every folder loaded under every case, its plan and what it holds ({(folder, case): ...}), or
    the load's refusal."""
    from xdit_lab import RankMesh, load_pipeline
    from xdit_lab.model_folder import read_model_folder
    from xdit_lab.models.sharded_weights import held_checkpoint_bytes
    from xdit_lab.pipeline import ON_HOST

    found = {}
    for name, folder in folders.items():
        text_encoders = tuple(read_model_folder(folder).text_encoders)
        for case, (config, options, _) in CASES.items():
            options = {k: text_encoders if v == "text encoders" else v for k, v in options.items()}
            try:
                pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, **options)
            except (ValueError, RuntimeError) as error:  # ParallelConfigError, QuantizationError: a refusal
                found[name, case] = dict(refused=f"{type(error).__name__}: {error}")
                continue
            modules = {n: c for n, c in pipe.diffusers_pipeline.components.items() if isinstance(c, torch.nn.Module)}
            found[name, case] = dict(
                planned=dict(pipe.memory_plan.per_rank_bytes),
                activations=dict(pipe.memory_plan.activation_bytes),
                held={n: 0 if getattr(c, ON_HOST, False) else held_checkpoint_bytes(c) for n, c in modules.items()},
            )
            pipe.close()
    return found


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Every tiny pipeline folder, each with its tiny call as its own call defaults (call_defaults.json, as the
    digits folder carries): the call a load plans for, and the one the planner plans by default."""
    saved = {family: save_tiny_pipeline(family, tmp_path_factory.mktemp(family)) for family in PIPELINES}
    saved["wan_2_1_i2v"] = _save_wan_2_1_i2v(tmp_path_factory.mktemp("wan_2_1_i2v"))
    for name, folder in saved.items():
        (folder / "call_defaults.json").write_text(json.dumps(tiny_pipeline_kwargs(_family(name))))
    return saved


def _family(name: str) -> str:
    return "wan" if name == "wan_2_1_i2v" else name


@pytest.fixture(scope="module")
def loads(folders):
    """What both ranks planned and held, every folder under every case: {(folder, case): [rank 0's, rank 1's]}."""
    ranks = run_on_ranks(_load_every_case, WORLD, folders, timeout_s=600)
    return {key: [rank[key] for rank in ranks] for key in ranks[0]}


@pytest.fixture(scope="module")
def planned_rows(folders):
    """The planner's rows for each folder on WORLD GPUs, in the load dtype on a CPU (float32), quantized or not."""
    from xdit_lab.families import RECIPES
    from xdit_lab.plan import plan_model

    rows = {}
    for name, folder in folders.items():
        pipeline_class = json.loads((folder / "model_index.json").read_text())["_class_name"]
        defaults = json.loads((folder / "call_defaults.json").read_text())
        use_cfg = _two_branches(RECIPES[pipeline_class], pipeline_class, defaults)
        for quantize in (None, "int8"):
            rows[name, quantize] = plan_model(
                folder, WORLD, PLENTY, dtype=torch.float32, quantize=quantize, use_cfg=use_cfg
            )
    return rows


def _two_branches(recipe, pipeline_class, folder_defaults: dict) -> bool:
    """Whether the load plans two branches: one prompt at the call defaults, a negative prompt counted as given
    where the recipe's CFG needs one (a call may bring it: Qwen-Image's true CFG)."""
    from xdit_lab.families import Request

    defaults = recipe.call_defaults(pipeline_class) | folder_defaults
    negatives = None if recipe.cfg_needs is None else [""]
    request = Request(["a prompt"], negatives, 1, defaults["guidance_scale"], None, None, None)
    request.options = recipe.check_options({k: v for k, v in defaults.items() if k in recipe.options})
    return recipe.do_cfg(request)


def _row(rows, config, shard, placement):
    return next(
        (r for r in rows if r.config == config and r.shard_weights == shard and r.text_encoders == placement), None
    )


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("folder", FOLDERS)
def test_the_load_plans_the_planners_row_and_holds_it(loads, planned_rows, folder, case):
    config, _, (shard, placement, quantize) = CASES[case]
    ranks = loads[folder, case]
    rows = planned_rows[folder, quantize]
    row = _row(rows, config, shard, placement)
    if "refused" in ranks[0]:
        assert row is None, f"the load refuses {case} ({ranks[0]['refused']}), the planner has a row: {row.weights}"
        return
    assert row is not None, f"the load runs {case}, the planner has no {config.short()} {placement} row"
    held = {n: max(rank["held"][n] for rank in ranks) for n in ranks[0]["held"]}  # the busiest rank's, each
    planned = {n: b for n, b in ranks[0]["planned"].items() if b or n in row.weights}  # tokenizers: no weights
    assert planned == row.weights, f"load's plan {planned}, planner's row {row.weights}"
    assert held == row.weights, f"held {held}, planner's row {row.weights}"
    activations = ranks[0]["activations"]  # (one rank, per rank): the gathers and the kept K/V are the row's too
    assert activations.get("weight gathers", (0, 0))[1] == row.gather, f"load {activations}, row {row.gather}"
    assert activations.get("stale K/V", (0, 0))[1] == row.stale_kv, f"load {activations}, row {row.stale_kv}"
    assert (row.stale_kv > 0) == (config.pipefusion > 1), f"{case}: stale K/V {row.stale_kv}"  # planned before loading
    assert activations.get("decode peak", (0, None))[1] == row.decode_peak, f"load {activations}, row {row.decode_peak}"


@pytest.mark.parametrize("folder", FOLDERS)
def test_every_row_is_a_load_the_options_take(planned_rows, folders, folder):
    """A row says how to load it (row.load_options()), and load_pipeline takes those options for its configuration:
    the planner lists no holding load_pipeline cannot make (shard_weights shards the transformer and the text
    encoders together, so "text encoders sharded, the transformer whole" is no row), and a case's keywords are
    exactly its row's options."""
    from xdit_lab import LoadOptions
    from xdit_lab.families import recipe_for
    from xdit_lab.model_folder import read_model_folder

    model = read_model_folder(folders[folder])
    recipe = recipe_for(model.pipeline_class)
    for quantize in (None, "int8"):
        rows = planned_rows[folder, quantize]
        if isinstance(rows, Exception):
            pytest.skip(f"the planner plans no {folder} folder: {rows}")
        holdings = {(row.shard_weights, row.text_encoders) for row in rows}
        assert holdings <= LOADABLE, f"rows no load can make: {holdings - LOADABLE}"
        if quantize is None and model.text_encoders:  # ulysses 2 refuses none of them: every holding has rows
            assert holdings == LOADABLE, f"{folder}: rows for {sorted(holdings)} only"
        refused = [row.name() for row in rows if row.load_options().problems(recipe, model, row.config)]
        assert not refused, f"rows load_pipeline refuses: {refused}"
    for case, (config, keywords, (shard, placement, quantize)) in CASES.items():
        row = _row(planned_rows[folder, quantize], config, shard, placement)
        if row is None:  # refused: the identity test above holds the load to that
            continue
        keywords = {k: tuple(model.text_encoders) if v == "text encoders" else v for k, v in keywords.items()}
        assert row.load_options() == LoadOptions(**keywords), f"{case}: {row.load_options()} for {keywords}"
