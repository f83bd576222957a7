"""Tensor parallelism with the load options: compile and shard_weights.

compile=True under tp 2: the forward is one graph (dynamo's unique graphs), which three calls of one size do not
recompile and a new size does (the control: the instrument moves); its output equals eager's and diffusers' serial
forward (1e-4 · max(1, max |reference|), float32), and it records every collective eager records (tp's all-reduces
and gathers run as opaque operators, comm.all_reduce / comm.all_gather, recorded when they run), and torch runs
no other (DTensor sends nothing, compiled or not).

shard_weights=True under tp2·ulysses2: load_pipeline's latents equal diffusers' serial pipeline's; FSDP2 shards each
rank's tp slices over its weights group (2 ranks), so a rank holds what the planner planned (the tp slice's FSDP2
chunk) and the gather buffer planned (its tp slices whole), and each step's "weights" gathers are
weight_gather_bytes of the tp-split model's units (the control: of the whole model's, which they are not); tp's
and Ulysses' bytes are the closed form's. Both at once: exact, recorded as eager, no graph made after the first call.

Quantized weights stay refused (tests/test_tensor_parallel.py: torchao's tensors implement no aten.split)."""

import pytest
import torch
from forward_traffic import sample, session_traffic

from xdit_lab import ParallelConfig, comm_log, load_pipeline, parallelize
from xdit_lab.mesh import RankMesh
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer

TP2 = ParallelConfig(tp=2)


def _inputs(family, seed, size=8):
    return tiny_inputs(family, 2, height=size, width=size, text_len=8, seed=seed)


def _torch_collectives(model, **inputs) -> int:
    """The collectives torch runs during `model(**inputs)`, as its profiler sees the dispatcher's operators: c10d's (what
    comm calls) and the functional ones a compiled graph holds (what DTensor would send), waits and receives left
    out. A dispatch mode cannot count them here: dynamo runs a frame eagerly under one."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        model(**inputs)
    names = [event.name for event in profiler.events()]
    return sum(1 for n in names if n.startswith(("c10d::", "_c10d_functional::")) and not ("wait" in n or "recv" in n))


def _compiled(families, backend):
    """Per family: each of three calls (new inputs, one size) of the model compiled under tp 2 against eager tp 2
    and the serial model; dynamo's counters after them; then one call at a new size (the control)."""
    mesh = RankMesh(TP2)
    rows = []
    for family in families:
        serial = tiny_transformer(family, seed=0)
        eager = parallelize(tiny_transformer(family, seed=0), TP2, mesh)
        compiled = parallelize(tiny_transformer(family, seed=0), TP2, mesh, compile=backend)
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        steps = []
        for seed, size in ((1, 8), (2, 8), (3, 8)):
            inputs = _inputs(family, seed, size)
            with torch.no_grad():
                reference = sample(serial(**inputs))
                with comm_log() as eager_log:
                    expected = sample(eager(**inputs))
            with comm_log() as compiled_log:
                output = sample(compiled(**inputs))  # as a newcomer calls it: no torch.no_grad needed
            records = [[(r.op, r.group, r.bytes_out, r.tag) for r in log] for log in (eager_log, compiled_log)]
            steps.append(
                dict(
                    error=(output - reference).abs().max().item(),
                    eager_error=(expected - reference).abs().max().item(),
                    bound=1e-4 * max(1.0, reference.abs().max().item()),
                    same_records=records[0] == records[1],
                    ops={(op, group) for op, group, _, _ in records[1]},
                    recorded=len(records[1]),
                )
            )
        settled = (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))
        compiled(**_inputs(family, 4, size=16))  # the control: a new size compiles again
        moved = (counters["stats"]["unique_graphs"], sum(counters["recompiles"].values()))
        # last (torch's profiler guards a graph of its own): every collective torch ran is one comm recorded
        collectives = _torch_collectives(compiled, **_inputs(family, 5))
        rows.append(dict(family=family, steps=steps, settled=settled, moved=moved, collectives=collectives))
    return rows


@pytest.mark.timeout(960)
def test_tp2_compiled_is_one_graph_equal_to_eager_and_serial_diffusers():
    """Flux (diffusers' _tp_plan: packed single-block layers, gathered modulations) and Wan (the adapter's plan, a
    norm over every head whose sum of squares is all-reduced inside a replaced forward), with the backend
    "aot_eager": dynamo's graph, guards and functionalized operators as compile=True makes them, eager kernels
    (tests/test_compile.py says why inductor runs elsewhere)."""
    for rows in run_on_ranks(_compiled, 2, ["flux", "wan"], "aot_eager", timeout_s=900):
        for row in rows:
            family = row["family"]
            for step, s in enumerate(row["steps"]):
                where = f"{family} call {step}"
                assert s["error"] <= s["bound"] and s["eager_error"] <= s["bound"], (where, s)
                assert s["same_records"] and ("all_reduce", "tp") in s["ops"], (where, s["ops"])
            assert ("all_gather", "tp") in row["steps"][0]["ops"], row["steps"][0]["ops"]  # the gathered modulations
            assert row["collectives"] == row["steps"][0]["recorded"], f"{family}: a collective comm did not record"
            assert row["settled"] == (1, 0), row  # one graph, three calls of one size: nothing recompiled
            assert row["moved"][0] > 1, row  # the control: a new size compiles a graph of its own


PROMPTS = ["a red cat", "a blue dog"]


def _sharded(folder, config, kwargs):
    """load_pipeline with shard_weights under tp: its latents, the transformer's planned and held bytes, each
    step's bytes per group, and the "weights" gathers' closed form over the tp-split model's units and the whole
    model's (the control)."""
    from diffusers import FluxTransformer2DModel

    from xdit_lab.families import adapter_for
    from xdit_lab.lab.summaries import rank_summary
    from xdit_lab.lessons.families import output_latents
    from xdit_lab.models import parallel_state, weight_gather_bytes, weight_units
    from xdit_lab.models.sharded_weights import held_checkpoint_bytes

    mesh = RankMesh(config)
    pipe = load_pipeline(folder, config, mesh=mesh, progress=False, shard_weights=True)
    session = pipe.session(PROMPTS, seed=0, **kwargs).run()
    transformer = pipe.diffusers_pipeline.transformer
    state = parallel_state(transformer)
    units = {}
    for split in (True, False):
        model = FluxTransformer2DModel.from_pretrained(folder / "transformer")
        if split:
            model = parallelize(model, config, mesh)
        adapter = adapter_for(model)
        units[split] = weight_units(model, adapter.blocks(model), adapter.called_outside_their_block)
    size = state.weights.group_size
    memory = rank_summary(session)["memory"]  # the gather buffer a sharded forward holds, held and planned
    return dict(
        gathers=(memory["weight_gather_bytes"], memory["plan"]["activation_bytes"]["weight gathers"]),
        latents=output_latents(session.result(output_type="latent")),
        planned=pipe.memory_plan.per_rank_bytes["transformer"],
        held=held_checkpoint_bytes(transformer),
        sharded=(state.weights.group, size, state.weights.sharded, state.tensor.degree),
        traffic=session_traffic(session),
        closed=weight_gather_bytes(units[True], size),
        control=weight_gather_bytes(units[False], size),
    )


@pytest.mark.timeout(960)
def test_tp2_with_sharded_weights_equals_diffusers_pipeline(tmp_path):
    from diffusers import DiffusionPipeline

    from xdit_lab.lessons.families import output_latents

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    kwargs = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=2)
    reference = DiffusionPipeline.from_pretrained(folder)
    reference.set_progress_bar_config(disable=True)
    expected = output_latents(
        reference(prompt=list(PROMPTS), generator=torch.Generator().manual_seed(0), output_type="latent", **kwargs)
    )
    config = ParallelConfig(tp=2, ulysses=2)
    for rank, row in enumerate(run_on_ranks(_sharded, 4, folder, config, kwargs, timeout_s=900)):
        where = f"{config.short()} rank {rank}"
        error, bound = (row["latents"] - expected).abs().max().item(), 1e-4 * max(1.0, expected.abs().max().item())
        assert error <= bound, f"{where}: error {error:.3g} > {bound:.3g}"
        assert row["sharded"] == ("weights", 2, True, 2), where
        assert row["planned"] == row["held"], f"{where}: planned {row['planned']} bytes, held {row['held']}"
        assert row["gathers"][0] == row["gathers"][1] > 0, f"{where}: gather buffer held, planned {row['gathers']}"
        for step in row["traffic"]:
            moved = dict(step["moved"])
            assert moved.pop("weights") == row["closed"] != row["control"], (where, step)
            assert moved == step["expected"] and {"tp", "ulysses"} <= set(moved), (where, step)


def _sharded_and_compiled(config):
    """tp with shard_weights and compile together: three calls against eager (sharded alike) and the serial model,
    and dynamo's graphs after the first call and after the third."""
    mesh = RankMesh(config)
    serial = tiny_transformer("flux", seed=0)
    eager = parallelize(tiny_transformer("flux", seed=0), config, mesh, shard_weights=True)
    compiled = parallelize(tiny_transformer("flux", seed=0), config, mesh, shard_weights=True, compile="aot_eager")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    rows, graphs = [], []
    for seed in (1, 2, 3):
        inputs = _inputs("flux", seed)
        with torch.no_grad():
            reference = sample(serial(**inputs))
            with comm_log() as eager_log:
                sample(eager(**inputs))
        with comm_log() as compiled_log:
            output = sample(compiled(**inputs))
        records = [[(r.op, r.group, r.bytes_out, r.tag) for r in log] for log in (eager_log, compiled_log)]
        rows.append(
            (
                (output - reference).abs().max().item(),
                1e-4 * max(1.0, reference.abs().max().item()),
                records[0] == records[1],
                {group for _, group, _, _ in records[1]},
            )
        )
        graphs.append((counters["stats"]["unique_graphs"], sum(counters["recompiles"].values())))
    return rows, graphs


@pytest.mark.timeout(960)
def test_tp2_sharded_and_compiled_equals_serial_and_records_as_eager():
    """FSDP2's gathers run eagerly between compiled pieces (parallelize's docstring: a break at every unit), tp's
    collectives inside them: exact, recorded as eager records them, and no graph made after the first call."""
    config = ParallelConfig(tp=2, ulysses=2)
    for rank, (rows, graphs) in enumerate(run_on_ranks(_sharded_and_compiled, 4, config, timeout_s=900)):
        for call, (error, bound, same, groups) in enumerate(rows):
            where = f"rank {rank} call {call}"
            assert error <= bound and same and {"tp", "ulysses", "weights"} <= groups, (where, error, same, groups)
        assert graphs[0][0] > 1 and graphs[1:] == [graphs[0]] * 2 and graphs[0][1] == 0, graphs
