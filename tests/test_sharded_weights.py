"""Sharded weights (torch's FSDP2) under every strategy, against diffusers' serial forward.

One run_on_ranks call per world size covers every case; each reference is computed once, here in
the parent, from the same seeded tiny model and inputs the ranks build. Each rank reports, per case
and call: the error against serial, the "weights" gathers it recorded (count, bytes_out, group), what
it holds of the blocks (p.to_local() bytes), and its PipeFusion stage. The closed form
(weight_gather_bytes over weight_units) is computed here from an unsharded model's parameter shapes,
never from FSDP2's numbers, and compared with the records.

Controls, each run: the same model parallelized without shard_weights holds all of its blocks (above
the 0.6 bound); a formula without torch.chunk's padding misses Wan's records (its scale_shift_table
has a dim 0 of 1); a formula gathering each block once misses PipeFusion's records past warmup (one
gather per patch)."""

import warnings

import pytest
import torch

from xdit_lab import ParallelConfig, RankMesh, comm_log, parallelize
from xdit_lab.comm import comm_timeline
from xdit_lab.families import adapter_for
from xdit_lab.mesh import PIPEFUSION, WEIGHTS
from xdit_lab.models import StepCache, parallel_state
from xdit_lab.models.sharded_weights import (
    local_parameter_bytes,
    repeated_layers,
    shard_text_encoder,
    shard_weights,
    weight_gather_bytes,
    weight_units,
    whole_parameter_bytes,
)
from xdit_lab.sharding import stage_ranges
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

BATCH = 2


def _model(family):
    extra = {"max_text_seq_length": 8} if family == "cogvideox" else {}
    return tiny_transformer(family, seed=0, **extra)


def _inputs(family, seed):
    return tiny_inputs(family, BATCH, seed=seed, text_len=8 if family == "cogvideox" else 6)


def _case(family, config, *, calls=1, exact_calls=None, cache=False, compile=False, shard=True):
    """A case the ranks run: `calls` transformer calls with inputs of seeds 1.., of which the first
    `exact_calls` are compared with serial (PipeFusion past its warmup is stale, not exact)."""
    inputs = [_inputs(family, seed) for seed in range(1, calls + 1)]
    exact_calls = calls if exact_calls is None else exact_calls
    reference = _model(family)
    with torch.no_grad():
        expected = [reference(**x).sample for x in inputs[:exact_calls]]
    return dict(
        family=family,
        config=config,
        inputs=inputs,
        expected=expected,
        cache=cache,
        compile=compile,
        shard=shard,
        name=f"{family} {config.short()}{' cache' if cache else ''}{' compile' if compile else ''}"
        + ("" if shard else " unsharded"),
    )


def _run_cases(cases, encoders=None):
    """Each case on this rank: parallelize (sharded), run its calls, report what was seen. With
    `encoders` ({kind: expected output}), also the sharded text encoders and the refusals that need
    real ranks."""
    rows, meshes = [], {}
    for case in cases:
        config = case["config"]
        mesh = meshes.setdefault(config, RankMesh(config))
        model = _model(case["family"])
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            model = parallelize(
                model,
                config,
                mesh,
                cache=StepCache(0.0) if case["cache"] else None,
                compile=case["compile"],
                shard_weights=case["shard"],
            )
        state = parallel_state(model)
        calls = []
        for i, inputs in enumerate(case["inputs"]):
            with torch.no_grad(), comm_log() as log, comm_timeline() as timeline:
                output = model(**inputs).sample
            weights = [r for r in log if r.tag == "weights"]
            row = dict(
                count=len(weights),
                bytes_out=sum(r.bytes_out for r in weights),
                groups=sorted({r.group for r in weights}),
                ops=sorted({r.op for r in weights}),
                spans=sum(1 for s in timeline.spans if s.tag == "weights" and s.kind == "collective"),
                records=[(r.op, r.group, r.bytes_out, r.tag) for r in log],
            )
            if i < len(case["expected"]):
                expected = case["expected"][i]
                row["error"] = (output - expected).abs().max().item()
                row["bound"] = 1e-4 * max(1.0, expected.abs().max().item())
            calls.append(row)
        rows.append(
            dict(
                name=case["name"],
                stage=mesh.coords[PIPEFUSION],
                calls=calls,
                local_blocks=sum(local_parameter_bytes(b) for b in adapter_for(model).blocks(model)),
                units=state.weights.units if state.weights else None,
                reason=state.weights.reason if state.weights else None,
                warned=[str(w.message) for w in warned if "shard_weights" in str(w.message)],
                family_after=adapter_for(model).family,
                class_after=type(model).__name__,
                buffers=sorted({type(b).__name__ for b in model.buffers()}),
                dtype=str(next(model.parameters()).dtype),
                parameter_type=type(next(model.parameters())).__name__,
                patches=config.patches,
            )
        )
    if encoders is None:
        return rows
    return dict(rows=rows, encoders=_encoders_sharded(encoders), refusals=_refusals(next(iter(meshes.values()))))


def _refusals(mesh):
    """The refusals by name that need a process group: sharding twice, and a model sharded with
    fully_shard before parallelize."""
    from torch.distributed.fsdp import fully_shard

    messages = []
    model = parallelize(_model("pixart"), mesh.config, mesh, shard_weights=True)
    try:
        shard_weights(model, mesh, WEIGHTS, adapter_for(model).blocks(model))
    except ValueError as error:
        messages.append(str(error))
    model = _model("pixart")
    fully_shard(model, mesh=mesh.device_mesh(WEIGHTS))
    try:
        parallelize(model, mesh.config, mesh)
    except ValueError as error:
        messages.append(str(error))
    return messages


def _stage_units(case, stage):
    """weight_units of the blocks a stage holds (every block without PipeFusion), from an unsharded
    model's parameter shapes, and the separate units (DiT's conditioning, called outside its block)."""
    config, family = case["config"], case["family"]
    model = _model(family)
    adapter = adapter_for(model)
    if config.pipefusion > 1:
        start, stop = stage_ranges(adapter.num_blocks(model.config), config.pipefusion)[stage]
        adapter.keep_blocks(model, start, stop)
    separate = ["transformer_blocks.0.norm1.emb"] if family == "dit" else []
    return weight_units(model, adapter.blocks(model), separate), separate


def _block_bytes(units):
    """Whole bytes of the block units (the root "" left out)."""
    return sum(torch.Size(shape).numel() * element for name, ps in units.items() if name for shape, element in ps)


def _check(cases, per_rank):
    """Exact against serial on every rank, and, where something was sharded: FSDP2's class, every
    gather under the weights group and in the timeline, each call's bytes equal to the closed form,
    and at most 0.6 of the stage's block bytes held (1/N + padding)."""
    for rank, rows in enumerate(per_rank):
        for case, row in zip(cases, rows):
            where = f"{row['name']} rank {rank}"
            for i, call in enumerate(row["calls"]):
                if "error" in call:
                    assert call["error"] <= call["bound"], (
                        f"{where} call {i}: {call['error']:.3g} > {call['bound']:.3g}"
                    )
            assert row["family_after"] == adapter_for(_model(case["family"])).family, where
            group_size = case["config"].world_size // case["config"].pipefusion
            if not case["shard"] or group_size == 1:
                continue
            assert row["class_after"].startswith("FSDP") and row["parameter_type"] == "DTensor", where
            assert row["dtype"] == "torch.float32", where
            for call in row["calls"]:
                assert call["groups"] == [WEIGHTS] and call["ops"] == ["all_gather"], where
                assert call["spans"] == call["count"] > 0, where
            units, separate = _stage_units(case, row["stage"])
            assert set(units) == set(row["units"]), where
            assert row["local_blocks"] <= 0.6 * _block_bytes(units), where
            pf = case["config"].pipefusion > 1
            for i, call in enumerate(row["calls"]):
                stale = pf and i >= case["config"].warmup_steps  # one pass per patch: each pass gathers
                per_patch = {name: row["patches"] for name in units if name} if stale else {}
                # DiT's conditioning: in its block, and again by the output layer (not on a first stage)
                twice = {name: 2 for name in separate if not (pf and row["stage"] == 0)}
                gathers = {**per_patch, **twice}
                if case["cache"] and pf and row["stage"] == 0:  # StepCache's first pass runs block 0 alone first
                    gathers[row["units"][0]] = 2
                expected = weight_gather_bytes(units, group_size, gathers)
                assert call["bytes_out"] == expected, f"{where} call {i}: {call['bytes_out']} != {expected}"
                if stale:  # the control: a formula gathering each block once a call misses
                    assert call["bytes_out"] != weight_gather_bytes(units, group_size, twice), where


# ---- 2 ranks: one run for every case, the text encoders and the refusals ------------------------------

CASES_2 = [
    ("flux", ParallelConfig(ulysses=2), {"calls": 2}),  # the second call gathers again, the same bytes
    ("sd3", ParallelConfig(ulysses=2), {}),
    ("sd3", ParallelConfig(ulysses=2), {"compile": True}),
    ("pixart", ParallelConfig(cfg=2), {}),
    ("wan", ParallelConfig(dp=2), {}),
    ("qwenimage", ParallelConfig(ring=2), {}),
    ("cogvideox", ParallelConfig(ring=2), {"calls": 2, "cache": True}),
    ("dit", ParallelConfig(ulysses=2), {}),
    ("wan", ParallelConfig(ulysses=2), {"shard": False}),  # the memory control
    ("pixart", ParallelConfig(pipefusion=2, warmup_steps=1), {}),  # a stage of one rank: nothing to shard
]
ENCODERS = ["t5", "umt5", "clip", "clip_projection", "llama", "qwen_vl", "mistral3"]
VOCAB = 64
IDS = torch.arange(2 * 7).reshape(2, 7) % (VOCAB - 2)


def _encoder(kind):
    from xdit_lab.tiny import encoders

    if kind in ("t5", "umt5"):
        return encoders.t5_encoder(0, VOCAB, umt5=kind == "umt5")
    if kind.startswith("clip"):
        return encoders.clip_encoder(0, VOCAB, 32, projection=kind == "clip_projection")
    return {"llama": encoders.llama_encoder, "qwen_vl": encoders.qwen_vl_encoder}.get(kind, encoders.mistral3_encoder)(
        0, VOCAB
    )


def _encode(encoder):
    output = encoder(input_ids=IDS, attention_mask=torch.ones_like(IDS), output_hidden_states=True)
    return output.hidden_states[-1]


def _encoders_sharded(expected):
    mesh = RankMesh(ParallelConfig(dp=2))
    rows = {}
    for kind, reference in expected.items():
        encoder = _encoder(kind)
        whole = local_parameter_bytes(encoder)
        shards = shard_text_encoder(encoder, mesh)
        with torch.no_grad(), comm_log() as log:
            output = _encode(encoder)
        rows[kind] = dict(
            error=(output - reference).abs().max().item(),
            scale=reference.abs().max().item(),
            held=local_parameter_bytes(encoder) / whole,
            whole=whole_parameter_bytes(encoder) / whole,  # still the whole's bytes, counted from the shards
            gathers=len([r for r in log if r.tag == "weights" and r.group == "world"]),
            units=shards.units,
        )
    return rows


@pytest.fixture(scope="module")
def two_ranks():
    cases = [_case(family, config, **extra) for family, config, extra in CASES_2]
    expected, lists = {}, {}
    for kind in ENCODERS:
        encoder = _encoder(kind)
        with torch.no_grad():
            expected[kind] = _encode(encoder)
        lists[kind] = [name for name, _ in repeated_layers(encoder)]
    per_rank = run_on_ranks(_run_cases, 2, cases, expected, timeout_s=600)
    return dict(cases=cases, per_rank=per_rank, lists=lists)


def _rows(two_ranks, rank=0):
    return {row["name"]: row for row in two_ranks["per_rank"][rank]["rows"]}


def test_two_ranks_exact_and_closed_form(two_ranks):
    _check(two_ranks["cases"], [out["rows"] for out in two_ranks["per_rank"]])
    rows = _rows(two_ranks)
    held = {
        n: r["local_blocks"] / _block_bytes(_stage_units(c, r["stage"])[0])
        for c, (n, r) in zip(two_ranks["cases"], rows.items())
    }
    print("\nshare of the blocks held, rank 0: " + ", ".join(f"{n} {h:.3f}" for n, h in held.items()))
    print(
        "weights bytes_out, call 0, rank 0: " + ", ".join(f"{n} {r['calls'][0]['bytes_out']}" for n, r in rows.items())
    )


def test_two_ranks_hold_at_most_0_6_of_the_blocks_and_the_unsharded_control_all(two_ranks):
    for rank in range(2):
        rows = _rows(two_ranks, rank)
        control = rows["wan ulysses2 unsharded"]
        whole = _block_bytes(_stage_units(_case("wan", ParallelConfig(ulysses=2)), 0)[0])
        assert control["local_blocks"] == whole  # the control, run: every block whole on every rank
        sharded = rows["wan dp2"]["local_blocks"]
        assert sharded <= 0.6 * whole < control["local_blocks"], (rank, sharded, whole)


def test_two_ranks_padding_counts(two_ranks):
    """Wan's scale_shift_table has dim 0 of 1: rank 1 holds none of it but sends a padded shard."""
    units, _ = _stage_units(_case("wan", ParallelConfig(dp=2)), 0)
    unpadded = sum(torch.Size(shape).numel() * element for ps in units.values() for shape, element in ps) // 2
    recorded = _rows(two_ranks)["wan dp2"]["calls"][0]["bytes_out"]
    assert recorded == weight_gather_bytes(units, 2) > unpadded  # the control: the unpadded formula misses


def test_two_ranks_stage_of_one_is_a_no_op_said_by_name(two_ranks):
    for rank in range(2):
        row = _rows(two_ranks, rank)["pixart pf2"]
        assert row["units"] == () and "is the only one in its weights group" in row["reason"]
        assert row["warned"] and row["calls"][0]["count"] == 0 and row["class_after"] == "PixArtTransformer2DModel"


def test_two_ranks_fsdp_leaves_buffers_whole(two_ranks):
    # FSDP2 shards parameters only: PixArt's positions and Wan's rotary tables stay plain tensors
    assert _rows(two_ranks)["wan dp2"]["buffers"] == ["Tensor"]
    assert _rows(two_ranks)["pixart cfg2"]["buffers"] == ["Tensor"]


def test_two_ranks_compiled_sharded_records_as_eager(two_ranks):
    """compile=True takes sharded weights (nothing refused): FSDP2's hooks are dynamo-disabled, so its
    gathers run eagerly between compiled pieces; exact (checked above) and every record the eager one's."""
    for rank in range(2):
        rows = _rows(two_ranks, rank)
        eager, compiled = rows["sd3 ulysses2"], rows["sd3 ulysses2 compile"]
        assert compiled["calls"][0]["records"] == eager["calls"][0]["records"]
        assert compiled["calls"][0]["count"] == len(compiled["units"])


def test_two_ranks_text_encoders_equal_unsharded(two_ranks):
    lists = two_ranks["lists"]
    assert lists["t5"] == lists["umt5"] == ["encoder.block"] and lists["llama"] == ["layers"]
    assert all(name.endswith("encoder.layers") for kind in ("clip", "clip_projection") for name in lists[kind])
    assert len(lists["qwen_vl"]) == len(lists["mistral3"]) == 2  # a vision tower's blocks, the language layers
    for rank, out in enumerate(two_ranks["per_rank"]):
        for kind, row in out["encoders"].items():
            assert row["error"] <= 1e-5 * max(1.0, row["scale"]), (kind, rank, row)
            assert row["held"] <= 0.6 and row["whole"] == 1.0, (kind, rank, row)
            # each unit the prompt runs is gathered once; a vision tower never runs on text
            ran = [u for u in row["units"] if ".vision_tower." not in u and ".visual." not in u]
            assert row["gathers"] == len(ran), (kind, rank, row)
    held = two_ranks["per_rank"][0]["encoders"]
    print("\ntext encoders, share held on rank 0: " + ", ".join(f"{k} {r['held']:.3f}" for k, r in held.items()))


def test_two_ranks_refusals_by_name(two_ranks):
    for out in two_ranks["per_rank"]:
        twice, before = out["refusals"]
        assert "already sharded with fully_shard; shard a fresh one" in twice
        assert "sharded with fully_shard before parallelize: parallelize the whole model first" in before


# ---- 4 ranks: USP and PipeFusion stages ------------------------------------------------------------

CASES_4 = [
    ("flux", ParallelConfig(ulysses=2, ring=2), {}),
    ("wan", ParallelConfig(ulysses=2, ring=2), {}),
    ("pixart", ParallelConfig(pipefusion=2, cfg=2, warmup_steps=1), {"calls": 2, "exact_calls": 1}),
    ("flux", ParallelConfig(pipefusion=2, ulysses=2, warmup_steps=1), {"calls": 2, "exact_calls": 1}),
    ("sd3", ParallelConfig(pipefusion=2, cfg=2, warmup_steps=2), {"calls": 2, "cache": True}),
    ("qwenimage", ParallelConfig(pipefusion=2, dp=2, warmup_steps=1), {}),
]


def test_four_ranks_usp_and_pipefusion_stages():
    cases = [_case(family, config, **extra) for family, config, extra in CASES_4]
    per_rank = run_on_ranks(_run_cases, 4, cases, timeout_s=600)
    _check(cases, per_rank)
    for rank, rows in enumerate(per_rank):
        for case, row in zip(cases, rows):
            if case["config"].pipefusion == 1:  # usp: 4 ranks share the weights, each holds ~1/4
                whole = _block_bytes(_stage_units(case, 0)[0])
                assert row["local_blocks"] <= 0.3 * whole, (row["name"], rank)


# ---- refusals and the world of one, in this process ----------------------------------------------------


def test_weight_units_from_shapes_alone():
    """A cost model builds the units from a checkpoint's shapes: a model made on the meta device gives
    the same units and bytes as the real one."""
    with torch.device("meta"):
        meta = _model("flux")
    real = _model("flux")
    units = weight_units(real, adapter_for(real).blocks(real))
    assert weight_units(meta, adapter_for(meta).blocks(meta)) == units
    assert len(units) == 5 and weight_gather_bytes(units, 2) == sum(p.numel() * 4 for p in real.parameters()) // 2
    assert weight_gather_bytes(units, 4) == 3 * weight_gather_bytes(units, 2) // 2  # every dim 0 divides by 4
    pixart = _model("pixart")  # its scale_shift_tables have 6 and 2 rows: padded to 2 and 1 a rank on 4
    padded = weight_gather_bytes(weight_units(pixart, adapter_for(pixart).blocks(pixart)), 4)
    assert padded > 3 * sum(p.numel() * 4 for p in pixart.parameters()) // 4


def test_no_blocks_and_no_repeated_layers_are_refused_by_name():
    mesh = RankMesh(ParallelConfig(), rank=0, world_size=1)
    with pytest.raises(TypeError, match="shard_weights found no blocks to shard in Sequential"):
        shard_weights(torch.nn.Sequential(torch.nn.Linear(2, 2)), mesh, WEIGHTS, [])
    with pytest.raises(TypeError, match="shard_text_encoder found no repeated layers in Linear"):
        shard_text_encoder(torch.nn.Linear(2, 2), mesh)


def test_shard_weights_on_a_world_of_one_is_a_no_op_and_says_so():
    config = ParallelConfig()
    model = _model("flux")
    inputs = _inputs("flux", 1)
    with torch.no_grad():
        expected = model(**inputs).sample
    with pytest.warns(UserWarning, match="is the only one in its weights group"):
        model = parallelize(model, config, RankMesh(config, rank=0, world_size=1), shard_weights=True)
    weights = parallel_state(model).weights
    assert not weights.sharded and weights.group_size == 1 and "nothing to shard" in weights.reason
    assert type(model).__name__ == "FluxTransformer2DModel"  # FSDP2 was never applied
    with torch.no_grad():
        error = (model(**inputs).sample - expected).abs().max().item()
    assert error <= 1e-4 * max(1.0, expected.abs().max().item())
