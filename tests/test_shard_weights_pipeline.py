"""load_pipeline(folder, config, shard_weights=True) as a newcomer calls it: every family's pipeline with its
transformer sharded over the ranks that hold the same weights and its text encoders over the world
(torch's FSDP2), each rank reading only its own rows, against diffusers' own pipeline run serially.

Per family one configuration on 2 ranks (one spawned run for all of them), and two on 4 ranks (USP, and
PipeFusion whose stages are each held by two ranks). For every run: the latents within 1e-4 relative of
diffusers'; what each rank holds of each component (its parameter shards and whole buffers, counted
tensor by tensor) equal to the load's memory plan on the busiest rank, and at most 0.6 of the whole
on 2 ranks (1.2/N over N ranks: FSDP2 pads dim 0); the gathers recorded under "weights", in the encode (the text encoders) and in every step
(the transformer). A text encoder kept on the host holds nothing on the rank's device and encodes the same.
"""

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, comm_log, load_pipeline
from xdit_lab.lessons.families import output_latents
from xdit_lab.models.sharded_weights import held_checkpoint_bytes
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PROMPTS = ["a red cat", "a blue dog"]
STEPS = 3
# family: (configuration on 2 ranks, text encoders kept on the host): every degree and a placement each
TWO_RANKS = {
    "flux": (ParallelConfig(ulysses=2), ()),
    "sd3": (ParallelConfig(cfg=2), ()),
    "pixart": (ParallelConfig(ring=2), ()),
    "qwenimage": (ParallelConfig(ring=2), ()),
    "hunyuanvideo": (ParallelConfig(ulysses=2), ("text_encoder",)),
    "cogvideox": (ParallelConfig(dp=2), ()),
    "wan": (ParallelConfig(ulysses=2), ()),
    "flux2": (ParallelConfig(dp=2), ()),
    "zimage": (ParallelConfig(cfg=2), ()),
}
FOUR_RANKS = {
    "sd3": ParallelConfig(ulysses=2, ring=2),
    "pixart": ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=STEPS),  # every step warm: exact
}
TRUE_CFG = ("flux", "qwenimage", "hunyuanvideo")


def _kwargs(family):
    kwargs = dict(tiny_pipeline_kwargs(family), num_inference_steps=STEPS)
    if family in TRUE_CFG:  # two branches, so that cfg has them to split (Flux.2 has one)
        kwargs.update(true_cfg_scale=2.0, negative_prompt=["", "a photo"])
    elif family != "flux2":
        kwargs.update(guidance_scale=3.0, negative_prompt=["", "a photo"])
    return kwargs


def _local_parameters(module) -> int:
    return sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in module.parameters())


def _whole(folder, name) -> int:
    from xdit_lab.plan import component_tensor_bytes

    return sum(component_tensor_bytes(folder / name, torch.float32).values())


def _sharded_runs(cases):
    """On this rank, per (family, folder, config, on_host): the latents, what it holds per component, the
    load's plan, and the bytes it sent per group in the encode and in each step."""
    rows = []
    for family, folder, config, on_host in cases:
        pipe = load_pipeline(folder, config, mesh=RankMesh(config), progress=False, shard_weights=True, on_host=on_host)
        inner = pipe.diffusers_pipeline
        with comm_log() as log:
            output = pipe(PROMPTS, seed=0, output_type="latent", **_kwargs(family))
        tagged = {}
        for record in log.filter(op="all_gather"):
            if record.tag == "weights":
                tagged[record.group] = tagged.get(record.group, 0) + record.bytes_out
        rows.append(
            dict(
                family=family,
                config=config.short(),
                world_size=config.world_size,
                pipefusion=config.pipefusion,
                latents=output_latents(output),
                held={
                    n: held_checkpoint_bytes(c) for n, c in inner.components.items() if isinstance(c, torch.nn.Module)
                },
                parameters={  # (this rank's, the whole model's) parameter bytes
                    n: (_local_parameters(c), sum(p.numel() * p.element_size() for p in c.parameters()))
                    for n, c in inner.components.items()
                    if isinstance(c, torch.nn.Module)
                },
                on_device={
                    n: {p.device.type for p in c.parameters()}
                    for n, c in inner.components.items()
                    if isinstance(c, torch.nn.Module)
                },
                planned=dict(pipe.memory_plan.per_rank_bytes),
                gathers=pipe.memory_plan.activation_bytes.get("weight gathers"),
                weights=tagged,  # "weights"-tagged gathers: text encoders over the world, the transformer over "weights"
                steps=output.comm_per_step,
            )
        )
        pipe.close()
    return rows


def _references(folders):
    from diffusers import DiffusionPipeline

    found = {}
    for family, folder in folders.items():
        reference = DiffusionPipeline.from_pretrained(folder)
        reference.set_progress_bar_config(disable=True)
        output = reference(
            prompt=list(PROMPTS),  # a copy: ZImagePipeline writes each prompt's chat template into the list
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
            **_kwargs(family),
        )
        found[family] = output_latents(output)
    return found


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return {family: save_tiny_pipeline(family, tmp_path_factory.mktemp(family)) for family in TWO_RANKS}


def _check(rows, folders, references, world_size):
    for rank, rank_rows in enumerate(rows):
        for row in rank_rows:
            family, where = row["family"], f"{row['family']} {row['config']} rank {rank}"
            expected = references[family]
            error = ((row["latents"] - expected).abs().max() / expected.abs().max()).item()
            assert error < 1e-4, f"{where}: {error:.2e} from diffusers"
            on_host = TWO_RANKS[family][1] if world_size == 2 else ()
            for name, held in row["held"].items():
                if name in on_host:  # whole, in host memory; nothing of it planned on the rank's device
                    assert row["on_device"][name] == {"cpu"} and row["planned"][name] == 0, where
                    assert held == _whole(folders[family], name), where
                    continue
                if rank == 0:  # the busiest rank: torch.chunk gives the first ranks the extra rows
                    assert held == row["planned"][name], f"{where} {name}: holds {held}, planned {row['planned'][name]}"
                if name == "transformer" or name.startswith("text_encoder"):  # of its parameters (DTensor numel: whole)
                    local, whole = row["parameters"][name]  # of what this rank's model has (a stage: its blocks)
                    ranks = world_size // row["pipefusion"] if name == "transformer" else world_size
                    share = local / whole
                    assert share <= 1.2 / ranks, f"{where} {name}: holds {share:.2f} of it over {ranks} ranks"
            assert row["gathers"] and row["gathers"][1] > 0, where  # planned: what a sharded forward holds whole
            encoders_gathered = row["weights"].get("world", 0)
            assert encoders_gathered > 0, f"{where}: the text encoders were not gathered"
            stage_ranks = row["world_size"] // row["pipefusion"]
            if stage_ranks > 1:  # the transformer is sharded over its stage's ranks: gathered in every step
                assert all(step.get("weights", 0) > 0 for step in row["steps"]), f"{where}: a step gathered nothing"


def test_every_family_sharded_equals_diffusers_on_two_ranks(folders):
    references = _references(folders)
    cases = [(family, folders[family], config, on_host) for family, (config, on_host) in TWO_RANKS.items()]
    _check(run_on_ranks(_sharded_runs, 2, cases, timeout_s=420), folders, references, 2)


def test_sharded_usp_and_pipefusion_on_four_ranks(folders):
    chosen = {family: folders[family] for family in FOUR_RANKS}
    references = _references(chosen)
    cases = [(family, folders[family], config, ()) for family, config in FOUR_RANKS.items()]
    _check(run_on_ranks(_sharded_runs, 4, cases, timeout_s=420), chosen, references, 4)


def _one_rank(folder):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = load_pipeline(folder, progress=False, shard_weights=True)
    said = [str(w.message) for w in caught if "shard_weights=True" in str(w.message)]
    sharded = any(hasattr(p, "to_local") for p in pipe.diffusers_pipeline.transformer.parameters())
    return said, sharded


def test_shard_weights_on_one_rank_is_a_no_op_and_says_so(folders):
    said, sharded = run_on_ranks(_one_rank, 1, folders["pixart"])[0]
    assert said and "nothing to shard" in said[0] and "ParallelConfig(ulysses=2)" in said[0]
    assert not sharded


def test_a_keyword_load_pipeline_does_not_know_is_refused_by_name(folders):
    with pytest.raises(TypeError, match=r"'shard_wieghts' \(did you mean 'shard_weights'\?\)"):
        load_pipeline(folders["pixart"], shard_wieghts=True)
    with pytest.raises(ValueError, match=r"on_host names 'text_encoder_9'.*its text encoders are 'text_encoder'"):
        load_pipeline(folders["pixart"], on_host=("text_encoder_9",))
