"""torch.compile takes the parallel forward whole: one graph, no breaks, for every family under
ulysses and ring (dynamo's explain, or compiled for one family per way of holding text and
positions), for usp, cfg and dp; compiled outputs equal eager ones, the bytes recorded are the same, and
steps do not recompile. PipeFusion is refused by name (a StepCache compiles: tests/test_step_cache_flux2_controlnet_compile.py)."""

import pytest
import torch

from xdit_lab import ParallelConfig, comm_log, load_pipeline, parallelize
from xdit_lab.mesh import RankMesh
from xdit_lab.models import StepCache
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

FAMILIES = ["pixart", "sd3", "flux", "flux2", "qwenimage", "hunyuanvideo", "cogvideox", "wan", "dit", "zimage", "sana"]
TEXT_LEN = 6


def _model(family):
    extra = {"max_text_seq_length": TEXT_LEN} if family == "cogvideox" else {}
    return tiny_transformer(family, seed=0, **extra)


def _graphs(cases):
    """(family, config, graphs, breaks, reasons) of torch._dynamo.explain on each parallel model, for
    each case (config, family, break_at_block): break_at_block is the control, a graph break forced
    inside the first block, that explain must see."""
    rows, meshes = [], {}
    for config, family, break_at_block in cases:
        mesh = meshes.setdefault(config, RankMesh(config))
        model = parallelize(_model(family), config, mesh)
        if break_at_block:
            model.transformer_blocks[0].register_forward_hook(lambda *_: torch._dynamo.graph_break())
        with torch.no_grad():  # what a model makes once on its first call, eagerly (Z-Image's rotary tables, made
            model(**tiny_inputs(family, 2, text_len=TEXT_LEN))  # under a torch.device dynamo cannot enter)
        torch._dynamo.reset()
        with torch.no_grad():
            found = torch._dynamo.explain(model)(**tiny_inputs(family, 2, text_len=TEXT_LEN))
        reasons = sorted({str(b.reason).splitlines()[0] for b in found.break_reasons})
        rows.append((family, config.short(), found.graph_count, found.graph_break_count, reasons))
    return rows


# one family per way of holding text and positions, compiled beside eager in
# test_compiled_equals_eager_records_the_same_bytes_and_does_not_recompile, which also asserts one graph
# (dynamo's unique graphs) and no recompiles over three calls: the explain sweep below leaves these out.
# All five use the backend "aot_eager": the same dynamo graph, guards and functionalized collectives as a user's
# compile=True, run by eager kernels (#38). Inductor itself (whose kernels a cold cache builds in about a minute
# per model on the CI's two cores) runs in two other tests, each a compile a user makes, one per way the
# attention's collectives run inside its opaque operator: tests/test_run_cli.py's --compile (PixArt under ulysses 2,
# the pipeline over every step) and tests/test_quantization.py's int8 Flux under ring 2 (torchao's weights, which
# inductor builds kernels of its own for). A third, here, would build kernels for one more model and add no way
# of running our operators that those two lack (#59).
COMPILED = [
    ("sd3", ParallelConfig(ulysses=2), "aot_eager"),  # text after the image
    ("flux2", ParallelConfig(ring=2), "aot_eager"),  # text first, image ids sharded before the forward
    ("qwenimage", ParallelConfig(ring=2), "aot_eager"),  # padded text: a key mask handed to the attention operator
    ("cogvideox", ParallelConfig(ring=2), "aot_eager"),  # text and image embedded in one tensor
    ("wan", ParallelConfig(ulysses=2), "aot_eager"),  # a grid sharded at the embedding, rotary tables hooked
    (
        "sana",
        ParallelConfig(ring=2),
        "aot_eager",
    ),  # no SDPA: linear-attention sums and halo rows, operators of their own
]
TRACED = {
    # the attention operator and the shard, rotary and gather hooks, every family's own places (those
    # compiled above left out); cfg and dp split the batch and gather it at the forward's edges, the same
    # two hooks for every family (models/hooks.py split_batch, gather_batch): one family traces them (#38)
    2: [
        (config, family)
        for config in (ParallelConfig(ulysses=2), ParallelConfig(ring=2))
        for family in FAMILIES
        if (family, config) not in [(f, c) for f, c, _ in COMPILED]
    ]
    + [(ParallelConfig(cfg=2), "pixart"), (ParallelConfig(dp=2), "pixart")],
    # USP: the attention is one operator whatever runs inside it, so one family per way of holding
    # text and positions; cfg and dp beside sp are the same hooks as above
    4: [(ParallelConfig(ulysses=2, ring=2), family) for family in ["sd3", "flux2", "cogvideox", "wan", "sana"]],
}
CONTROL = (ParallelConfig(ulysses=2), "flux")  # a graph break forced in the first block, in the same spawn


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.timeout(1020)
def test_every_family_traces_as_one_graph(world_size):
    """torch._dynamo.explain sees one graph and no break in each case of TRACED; on 2 ranks the control,
    a graph break forced inside the first block, is counted (the instrument can fail)."""
    cases = [(config, family, False) for config, family in TRACED[world_size]]
    if world_size == 2:
        cases.append((*CONTROL, True))
    for rows in run_on_ranks(_graphs, world_size, cases, timeout_s=900):
        assert len(rows) == len(cases)
        for (_, _, control), (family, config, graphs, breaks, reasons) in zip(cases, rows):
            if control:
                assert breaks >= 1 and graphs >= 2, (family, config, graphs, breaks)
            else:
                assert (graphs, breaks) == (1, 0), (family, config, reasons)


def _compiled_against_eager(cases):
    """Three forwards with different inputs, compiled (each case's backend) beside eager: the largest relative
    error, whether every collective recorded matches, and dynamo's graph and recompile counts. The
    control: at each step after the first the compiled model is also run on this step's inputs with the
    previous step's timestep, as a graph that kept a value of an earlier call would compute; its error
    against eager must exceed the bound."""
    rows = []
    meshes = {}
    for family, config, compile in cases:
        mesh = meshes.setdefault(config, RankMesh(config))
        eager = parallelize(_model(family), config, mesh)
        compiled = parallelize(_model(family), config, mesh, compile=compile)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        errors, same_records, control_errors, previous = [], [], [], None
        for step in range(3):
            inputs = tiny_inputs(family, 2, text_len=TEXT_LEN, seed=step + 1)
            with torch.no_grad(), comm_log() as eager_log:
                expected = eager(**inputs).sample
            with comm_log() as compiled_log:
                output = compiled(**inputs).sample  # as a newcomer calls it: no torch.no_grad needed
            errors.append(((output - expected).abs().max() / expected.abs().max()).item())
            records = [[(r.op, r.group, r.bytes_out, r.tag) for r in log] for log in (eager_log, compiled_log)]
            same_records.append(records[0] == records[1] and len(records[0]) > 0)
            if previous is not None:  # the control: a stale timestep (same shapes, so no recompile)
                stale = compiled(**dict(inputs, timestep=previous)).sample
                control_errors.append(((stale - expected).abs().max() / expected.abs().max()).item())
            previous = inputs["timestep"]
        counters = torch._dynamo.utils.counters
        rows.append(
            dict(
                family=family,
                config=config.short(),
                compile=compile,
                error=max(errors),
                control_error=min(control_errors),
                same_records=same_records,
                graphs=counters["stats"]["unique_graphs"],
                recompiles=sum(counters["recompiles"].values()),
            )
        )
    return rows


@pytest.mark.timeout(1020)
def test_compiled_equals_eager_records_the_same_bytes_and_does_not_recompile():
    # one family per way of holding text and positions (PixArt under cfg 2: tests/test_run_cli.py's --compile)
    for rows in run_on_ranks(_compiled_against_eager, 2, COMPILED, timeout_s=900):
        for row in rows:
            assert row["error"] < 1e-4, row
            assert row["control_error"] > 1e-4, row  # the bound catches a graph computing on a stale value
            assert all(row["same_records"]), row
            assert row["graphs"] == 1 and row["recompiles"] == 0, row


# The bundled pipeline compiled over steps (latents equal to diffusers', one graph per rank over every
# step, so nothing recompiled) is tests/test_run_cli.py's `--compile` case, run as a user runs it.


def test_pipefusion_is_refused_before_loading():
    with pytest.raises(Exception, match="compile=True does not take PipeFusion") as refused:
        load_pipeline("digits", ParallelConfig(pipefusion=2), cache=StepCache(0.1), compile=True)
    assert type(refused.value).__name__ == "ParallelConfigError"
    assert "StepCache" not in str(refused.value)  # one reason: a StepCache compiles


def test_an_unknown_backend_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"compile='inductr': give True .*inductor.*aot_eager"):
        parallelize(_model("pixart"), ParallelConfig(), compile="inductr")
