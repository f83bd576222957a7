"""Rank summaries and views from real runs: a tiny PixArt stepped twice on 2 and 4 gloo ranks.

The summaries are checked against facts that can fail (shards tile the image, batch rows,
K/V ages as the buffers recorded them, bytes moved equal the closed forms, PipeFusion halves the
blocks); then every view is drawn from them and its structure checked (axes, images, bars), not
its pixels, against expectations worked out here (which rank owns which token)."""

import numpy as np
import pytest

from xdit_lab import ParallelConfig, RankMesh, load_pipeline
from xdit_lab.sharding import patch_ranges, shard_range
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

PF = dict(num_patches=2, warmup_steps=1)
# name: (config, prompts, (height, width) in pixels). 12 × 20 px is a 3 × 5 token grid: 15 tokens
# split 8 + 7 over ulysses 2, so the formula's uneven shards and padded gathers are exercised.
CASES = {
    "ulysses2": (ParallelConfig(ulysses=2), ["a cat", "a dog", "a car"], (12, 20)),
    "ring2": (ParallelConfig(ring=2), ["a cat"], (16, 16)),
    "cfg2": (ParallelConfig(cfg=2), ["a cat", "a dog"], (16, 16)),
    "pipefusion2": (ParallelConfig(pipefusion=2, **PF), ["a cat"], (16, 16)),
    "pipefusion2·ulysses2": (ParallelConfig(pipefusion=2, ulysses=2, **PF), ["a cat"], (16, 16)),
    "pipefusion2·ring2": (ParallelConfig(pipefusion=2, ring=2, **PF), ["a cat"], (16, 16)),  # stale K/V travel the ring
    "cfg2·dp2": (ParallelConfig(cfg=2, dp=2), ["a cat", "a dog", "a car"], (16, 16)),  # dp shares 2 + 1
    # the async schedule from the first step: latents go back to stage 0, the cfg gather runs per patch
    "cfg2·pipefusion2·async": (
        ParallelConfig(cfg=2, pipefusion=2, num_patches=2, warmup_steps=0, pipefusion_schedule="async"),
        ["a cat", "a dog"],
        (16, 16),
    ),
}


def _two_steps(folder, config, prompts, size, control=None):
    """Two steps, a rank summary after each; under `control`'s deliberately wrong K/V buffers when named."""
    from xdit_lab.lab.summaries import rank_summary
    from xdit_lab.lessons.controls import wrong_stale_kv

    pipe = load_pipeline(folder, config, progress=False, controls=wrong_stale_kv(control))
    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2, height=size[0], width=size[1])
    session = pipe.session(prompts, seed=0, timeline=True, **kwargs)
    after = [rank_summary(session.step()) for _ in range(2)]
    return dict(
        summaries=after, latent=session.latents[0, 0].numpy(), spans=session.last_step_spans, comm=session.comm_per_step
    )


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_pipeline("pixart", tmp_path_factory.mktemp("pixart"))


@pytest.fixture(scope="module")
def runs(folder):
    cache = {}

    def get(name):
        if name not in cache:
            config, prompts, size = CASES[name]
            cache[name] = run_on_ranks(_two_steps, config.world_size, folder, config, prompts, size, timeout_s=240)
        return cache[name]

    return get


def _final(runs, name):
    return [out["summaries"][-1] for out in runs(name)]


@pytest.mark.parametrize("name", CASES)
def test_shards_tile_the_token_grid_once_per_group(runs, name):
    summaries = _final(runs, name)
    groups = {}
    for s in summaries:  # ranks that share one image's rows (and, under PipeFusion, one stage)
        c = s["coords"]
        groups.setdefault((c["dp"], c["cfg"], c["pipefusion"]), []).append(s)
        config = CASES[name][0]
        if config.sp_degree == 1 and config.pipefusion == 1:  # no hook runs: every token on every rank
            assert s["shard"]["source"] == "whole (no sequence parallelism)"
        else:
            assert s["shard"]["source"] in ("SequenceShards.shard_range", "PatchLayout")  # recorded by the run
    config = CASES[name][0]
    assert len(groups) == config.dp * config.cfg * config.pipefusion
    for group in groups.values():
        covered = sorted(t for s in group for start, stop in s["shard"]["tokens"] for t in range(start, stop))
        assert covered == list(range(group[0]["image_tokens"]))
    if name == "ulysses2":
        assert [s["grid"] for s in summaries] == [[3, 5]] * 2
        assert [s["shard"]["tokens"] for s in summaries] == [[[0, 8]], [[8, 15]]]
    if name == "pipefusion2·ulysses2":  # each rank holds half of every patch (row band of 8 tokens)
        assert [s["shard"]["tokens"] for s in summaries] == [[[0, 4], [8, 12]], [[4, 8], [12, 16]]] * 2
        assert [s["shard"]["pipefusion"]["blocks"] for s in summaries] == [[0, 1], [0, 1], [1, 2], [1, 2]]


def test_batch_rows_per_rank(runs):
    rows = {name: [s["batch"]["rows"] for s in _final(runs, name)] for name in ("ulysses2", "cfg2", "cfg2·dp2")}
    assert rows["ulysses2"] == [list(range(6))] * 2  # 3 prompts × [uncond; cond], every rank all rows
    assert rows["cfg2"] == [[0, 1], [2, 3]]  # the unconditional half, the conditional half
    assert rows["cfg2·dp2"] == [[0, 1], [3, 4], [2], [5]]  # ranks: (dp0 cfg0) (dp0 cfg1) (dp1 cfg0) (dp1 cfg1)
    assert not any(s["batch"]["stand_in"] for s in _final(runs, "cfg2·dp2"))


@pytest.mark.parametrize("name", ["pipefusion2", "pipefusion2·ulysses2", "pipefusion2·ring2"])
def test_kv_ages_fresh_in_warmup_one_step_stale_after(runs, name):
    for out in runs(name):
        warm, pipelined = (s["staleness"] for s in out["summaries"])
        stage = out["summaries"][0]["coords"]["pipefusion"]
        assert warm["layers"] == pipelined["layers"] == [f"transformer_blocks.{stage}.attn1"]
        assert not warm["pipelined"] and pipelined["pipelined"]
        assert warm["buffer"] == pipelined["buffer"] == "StaleKV"
        for layer in warm["layers"]:
            assert warm["written_step"][layer] == [0, 0] and warm["age"][layer] == [0, 0]
            # step 1 rewrote both patches; patch 0 read patch 1's K/V from step 0 before it was rewritten
            assert pipelined["written_step"][layer] == [1, 1]
            assert pipelined["read_age"][layer] == [[0, 1], [0, 0]]
            assert pipelined["age"][layer] == [0, 1]
    assert all(s["staleness"] is None for s in _final(runs, "ulysses2"))


def test_kv_age_view_reads_what_the_buffers_recorded(runs, folder):
    """A deliberately wrong buffer (ReadBeforeWriteKV: attention reads before the fresh K/V are
    written, so a patch sees its own K/V from the step before) changes the K/V-age view: the ages
    come from what each read recorded, not from a rule about which patches should be fresh. The
    buffer ends the step with the same written steps as StaleKV, so a rule would not see it."""
    from xdit_lab.lab.stale_views import draw_staleness

    config, prompts, size = CASES["pipefusion2"]
    wrong = [
        out["summaries"][-1]
        for out in run_on_ranks(
            _two_steps, 2, folder, config, prompts, size, control="read before write", timeout_s=240
        )
    ]
    for s in wrong:
        staleness = s["staleness"]
        (layer,) = staleness["layers"]
        assert staleness["buffer"] == "ReadBeforeWriteKV" and staleness["written_step"][layer] == [1, 1]
        assert staleness["read_age"][layer] == [[1, 1], [0, 1]]  # each patch read its own slice one step old

    def ages(summaries):
        return np.asarray(draw_staleness(summaries).axes[0].images[0].get_array()).tolist()

    assert ages(_final(runs, "pipefusion2")) == [[0, 1], [0, 1]]  # (stage, layer) × patch: patch 0 fresh
    assert ages(wrong) == [[1, 1], [1, 1]]


# A deliberately wrong configuration per case, on the same ranks: its closed form must differ from
# what was measured, or the equality below would not show that the formula knows the configuration.
WRONG = {
    "ulysses2": ParallelConfig(ring=2),
    "ring2": ParallelConfig(ulysses=2),
    "cfg2": ParallelConfig(dp=2),
    "pipefusion2": ParallelConfig(ring=2),
    "pipefusion2·ulysses2": ParallelConfig(pipefusion=2, ring=2, **PF),
    "pipefusion2·ring2": ParallelConfig(pipefusion=2, ulysses=2, **PF),
    "cfg2·dp2": ParallelConfig(cfg=2, ring=2),
    "cfg2·pipefusion2·async": ParallelConfig(cfg=2, pipefusion=2, num_patches=2, warmup_steps=0),  # drained
}


@pytest.mark.parametrize("name", CASES)
def test_measured_bytes_equal_the_closed_forms(runs, name):
    from xdit_lab.traffic import expected_bytes_per_step

    config, wrong = CASES[name][0], WRONG[name]
    for s in _final(runs, name):
        measured = s["comm"]["measured"]  # comm_log's records of what the collectives moved
        assert len(measured) == 2 and all(measured)
        wrong_coords = RankMesh(wrong, rank=s["rank"], world_size=config.world_size).coords
        for step, moved in enumerate(measured):
            moved = {g: n for g, n in moved.items() if n}
            where = f"rank {s['rank']} step {step}"
            assert moved == expected_bytes_per_step(config, s["shapes"], coords=s["coords"], step=step), where
            assert moved != expected_bytes_per_step(wrong, s["shapes"], coords=wrong_coords, step=step), where
        # every degree above 1 shows its traffic in its group (dp with one sample per group moves nothing);
        # under the async schedule only the last stage gathers the prediction over cfg
        shown = set(measured[-1]) | (
            {"cfg"} if config.pipefusion_schedule == "async" and s["coords"]["pipefusion"] == 0 else set()
        )
        assert {g for g in ("ulysses", "ring", "pipefusion", "cfg") if getattr(config, g) > 1} <= shown


def test_closed_forms_by_hand(runs):
    """A few numbers worked out on paper, so the formula is not only checked against itself."""
    f32 = 4
    # ulysses 2, batch 6, 4 heads × 16, 2 layers, shards 8 + 7: q/k/v send 2 of 4 heads of the own
    # shard, o sends 2 heads of the other rank's tokens; then the token gather padded to 8 × 32 features
    u = [s["comm"]["measured"][-1] for s in _final(runs, "ulysses2")]
    assert u[0]["ulysses"] == 2 * (3 * 6 * 2 * 8 * 16 + 6 * 2 * 7 * 16) * f32
    assert u[1]["ulysses"] == 2 * (3 * 6 * 2 * 7 * 16 + 6 * 2 * 8 * 16) * f32
    assert u[0]["sp"] == u[1]["sp"] == 6 * 8 * 32 * f32
    # ring 2: one K/V block [2, B 2, 4, 8, 16] sent per layer
    assert all(s["comm"]["measured"][-1]["ring"] == 2 * 2 * 2 * 4 * 8 * 16 * f32 for s in _final(runs, "ring2"))
    # pipefusion 2, pipelined step: stage 0 sends two patches of [2, 8, 64]; stage 1 broadcasts [2, 8, 8, 8]
    pf = [s["comm"]["measured"][-1] for s in _final(runs, "pipefusion2")]
    assert pf == [{"pipefusion": 2 * 2 * 8 * 64 * f32}, {"pipefusion": 2 * 8 * 8 * 8 * f32}]


def test_memory_pipefusion_holds_half_the_blocks(runs):
    whole = _final(runs, "ring2")[0]["memory"]
    for name, ulysses in (("pipefusion2", 1), ("pipefusion2·ulysses2", 2)):
        for s in _final(runs, name):
            memory = s["memory"]
            assert memory["transformer_block_bytes"] * 2 == whole["transformer_block_bytes"]
            assert memory["parameter_bytes"]["transformer"] == (
                whole["parameter_bytes"]["transformer"] - whole["transformer_block_bytes"] // 2
            )
            assert memory["parameter_bytes"]["vae"] == whole["parameter_bytes"]["vae"]
            # one layer's K and V for the whole image: [B 2, 4/ulysses heads, 16 tokens, 16] float32, twice
            assert memory["kv_buffer_bytes"] == 2 * 2 * (4 // ulysses) * 16 * 16 * 4
    assert whole["kv_buffer_bytes"] == 0
    assert all(s["memory"]["activation_source"].startswith("session") for s in _final(runs, "ring2"))


def _visible_axes(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def _owners_by_hand(config, grid, dp, cfg, pf):
    """rows × cols of the rank computing each token of one (dp, cfg, stage) panel, from the rank
    order (ulysses fastest, then ring, pipefusion, cfg, dp) and the sequence split: one contiguous
    shard per sp rank (ring-major), of the whole image, or of every PipeFusion patch (row band)."""
    rows, cols = grid
    owner = np.full(rows * cols, -1)
    bands = patch_ranges(rows, cols, config.patches) if config.pipefusion > 1 else [(0, rows * cols)]
    for ring in range(config.ring):
        for ulysses in range(config.ulysses):
            rank = (((dp * config.cfg + cfg) * config.pipefusion + pf) * config.ring + ring) * config.ulysses + ulysses
            for first, last in bands:
                start, stop = shard_range(last - first, config.ring * config.ulysses, ring * config.ulysses + ulysses)
                owner[first + start : first + stop] = rank
    return owner.reshape(rows, cols)


@pytest.mark.parametrize("name", CASES)
def test_views_draw_from_the_summaries(runs, name, tmp_path):
    from matplotlib.patches import Rectangle

    from xdit_lab.lab.stale_views import draw_stale_reads, draw_staleness
    from xdit_lab.lab.views import draw_comm, draw_latent, draw_memory, draw_shards, legibility_problems

    outs = runs(name)
    summaries = [out["summaries"][-1] for out in outs]
    config = CASES[name][0]

    shards = draw_shards(summaries)
    panels = _visible_axes(shards)
    keys = [(dp, cfg, pf) for dp in range(config.dp) for cfg in range(config.cfg) for pf in range(config.pipefusion)]
    assert len(panels) == len(keys)
    for ax, key in zip(panels, keys):  # each panel: the rank that owns each token, as worked out by hand
        drawn = np.asarray(ax.images[0].get_array())
        assert np.array_equal(drawn, _owners_by_hand(config, summaries[0]["grid"], *key)), f"panel {key}"
    assert len(shards.legends[0].get_texts()) == config.world_size
    assert "x[" in shards._suptitle.get_text()

    stale = draw_staleness(summaries)
    if config.pipefusion > 1:
        assert len(stale.axes) == 2  # heatmap and colour bar
        ages = np.asarray(stale.axes[0].images[0].get_array())
        assert ages.shape == (2, 2) and ages.tolist() == [[0, 1], [0, 1]]  # (stage, layer) × patch
    else:
        assert len(stale.axes) == 1 and not stale.axes[0].images
    reads = draw_stale_reads(summaries)
    if config.pipefusion > 1:  # one panel per stage: reading patch × slice read, as the buffer recorded it
        drawn = [np.asarray(ax.images[0].get_array()).tolist() for ax in reads.axes if ax.images]
        assert drawn == [[[0, 1], [0, 0]]] * 2  # the triangle: patch 0 read patch 1's slice a step old
        assert not legibility_problems(reads)
    else:
        assert not reads.axes[0].images

    memory = draw_memory(summaries)
    segments = len(summaries[0]["memory"]["parameter_bytes"]) + 2
    assert len([p for p in memory.axes[0].patches if isinstance(p, Rectangle)]) == config.world_size * segments

    comm = draw_comm(summaries)
    groups = {g for s in summaries for g, n in s["comm"]["measured"][-1].items() if n}
    assert len(_visible_axes(comm)) == config.world_size
    for ax in _visible_axes(comm):
        assert len(ax.patches) == 2 * len(groups)  # measured and formula per group
        assert not [t for t in ax.texts if t.get_text() == "≠"]  # no mismatch marked

    latent = draw_latent(outs[0]["latent"], step=2, title="channel 0")
    assert len(latent.axes) == 2 and "step 2" in latent.axes[0].get_title()
    assert len(draw_latent(np.zeros((4, 4, 3)), step=0).axes) == 1

    for view, fig in (("shards", shards), ("staleness", stale), ("memory", memory), ("comm", comm), ("latent", latent)):
        assert not legibility_problems(fig), (view, legibility_problems(fig))  # >= 100 dpi, >= 9 pt, nothing cut off
        fig.savefig(tmp_path / f"{view}.png")
        assert (tmp_path / f"{view}.png").stat().st_size > 1000


def test_batch_rows_are_written_as_ranges():
    from xdit_lab.lab.views import spans

    assert spans([3, 0, 1, 2, 7, 9, 10]) == "0–3, 7, 9–10" and spans([1, 1, 0, 0]) == "0–1"
    assert spans(range(10, 20)) == "10–19" and spans([5]) == "5" and spans([]) == "none"


def _flux_two_steps(folder):
    from xdit_lab.lab.summaries import rank_summary

    pipe = load_pipeline(folder, ParallelConfig(pipefusion=2, **PF), progress=False)
    session = pipe.session(["a cat"], seed=0, **dict(tiny_pipeline_kwargs("flux"), num_inference_steps=2))
    return [rank_summary(session.step()) for _ in range(2)]


def test_kv_age_view_on_flux_names_both_block_lists(tmp_path):
    """Flux under PipeFusion 2: its 2 double-stream and 2 single-stream blocks are one stack of 4, so
    stage 0 holds the double-stream ones and stage 1 the single-stream ones; the K/V-age view names
    each stage's joint attention layers as the whole model does, in the forward's order, with the
    ages its buffers recorded (patch 0 read patch 1's image K/V from the step before)."""
    from xdit_lab.lab.stale_views import draw_staleness

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    ranks = run_on_ranks(_flux_two_steps, 2, folder, timeout_s=240)
    expected = [
        [f"transformer_blocks.{i}.attn" for i in range(2)],
        [f"single_transformer_blocks.{i}.attn" for i in range(2)],
    ]
    for rank, (warm, pipelined) in enumerate(ranks):
        staleness = pipelined["staleness"]
        assert staleness["layers"] == expected[rank]
        for layer in staleness["layers"]:
            assert staleness["written_step"][layer] == [1, 1]
            assert staleness["read_age"][layer] == [[0, 1], [0, 0]]
        assert warm["staleness"]["age"][expected[rank][0]] == [0, 0]
    figure = draw_staleness([pipelined for _, pipelined in ranks])
    assert len(figure.axes[0].images) == 1
    # bytes per step equal the closed form, which counts the text states stage 0 hands on with each
    # patch: without them (control) it falls short on stage 0
    from xdit_lab.traffic import expected_bytes_per_step

    config = ParallelConfig(pipefusion=2, **PF)
    for rank, (_, s) in enumerate(ranks):
        for step, moved in enumerate(s["comm"]["measured"]):
            moved = {g: n for g, n in moved.items() if n}
            assert moved == expected_bytes_per_step(config, s["shapes"], coords=s["coords"], step=step)
            without_text = expected_bytes_per_step(
                config, dict(s["shapes"], handed_text=False), coords=s["coords"], step=step
            )
            assert (moved != without_text) == (rank == 0), f"rank {rank} step {step}"


# ---- the timeline of a step (lab/timeline.py) ------------------------------------------------------------


@pytest.mark.parametrize("name", ["ulysses2", "ring2", "pipefusion2", "cfg2·pipefusion2·async"])
def test_the_timeline_holds_every_transfer_of_the_step(runs, name, tmp_path):
    """Each rank's last step: spans inside the step, their bytes those comm_log counted for the step,
    and every posting completed by a wait of its group. Without the postings (a control), Ring's and
    PipeFusion's bytes are missing."""
    import json

    from xdit_lab.lab.timeline import draw_timeline, in_flight, overlap_s, save_trace
    from xdit_lab.lab.views import legibility_problems

    per_rank = {rank: out["spans"] for rank, out in enumerate(runs(name))}
    sending = []
    for rank, out in enumerate(runs(name)):
        step, spans = out["spans"], out["spans"]["spans"]
        assert step["step"] == 1 and all(0 <= s["start_s"] <= s["end_s"] <= step["seconds"] for s in spans)
        counted = sum(out["comm"][-1].values())
        assert sum(s["bytes_out"] for s in spans if s["kind"] != "wait") == counted, (rank, spans)
        posts = [s for s in spans if s["kind"] == "post"]
        assert len(in_flight(spans)) == len(posts)  # nothing posted is left unwaited within the step
        if name == "ulysses2":
            assert not posts and {s["op"] for s in spans} >= {"all_to_all"}
        if any(s["bytes_out"] for s in posts):  # control: the collectives alone miss the sends' bytes
            sending.append(rank)
            assert sum(s["bytes_out"] for s in spans if s["kind"] == "collective") < counted
        if name == "ring2":
            assert overlap_s(spans) > 0  # the next K/V block was in flight while this one's attention ran
    assert bool(sending) == (name != "ulysses2")  # Ring's K/V and PipeFusion's patches are sends
    fig = draw_timeline(per_rank)
    assert not legibility_problems(fig), legibility_problems(fig)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [f"rank {r}" for r in sorted(per_rank)]
    trace = json.loads(open(save_trace(per_rank, tmp_path / "step.json")).read())
    timed = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["cat"] != "step"]
    assert len(timed) == sum(len(out["spans"]["spans"]) for out in runs(name))
    assert {e["tid"] for e in timed} <= set(per_rank)


def test_a_pipefusion_step_is_the_patch_by_stage_chart(runs):
    """PipeFusion names each patch's compute in the step's timeline: on every stage the patches run
    in order, one at a time, never inside a collective or a wait, and the last stage starts patch p
    only once its wait for patch p's activations is over. The view draws one box per patch."""
    from matplotlib.collections import PolyCollection

    from xdit_lab.lab.timeline import draw_timeline
    from xdit_lab.lab.views import legibility_problems

    config = CASES["pipefusion2"][0]
    per_rank = {rank: out["spans"] for rank, out in enumerate(runs("pipefusion2"))}
    for rank, step in per_rank.items():
        computed = [s for s in step["spans"] if s["kind"] == "compute"]
        assert [s["tag"] for s in computed] == [f"patch {p}" for p in range(config.patches)], (rank, computed)
        assert all(a["end_s"] <= b["start_s"] for a, b in zip(computed, computed[1:])), rank
        blocking = [s for s in step["spans"] if s["kind"] in ("collective", "wait")]
        for c in computed:
            assert not any(b["start_s"] < c["end_s"] and c["start_s"] < b["end_s"] for b in blocking), (rank, c)
    waits = [s for s in per_rank[config.pipefusion - 1]["spans"] if s["kind"] == "wait"]
    computed = [s for s in per_rank[config.pipefusion - 1]["spans"] if s["kind"] == "compute"]
    assert all(wait["end_s"] <= patch["start_s"] for wait, patch in zip(waits, computed))
    fig = draw_timeline(per_rank)
    white = [
        c
        for c in fig.axes[0].collections
        if isinstance(c, PolyCollection) and tuple(c.get_facecolor()[0]) == (1.0, 1.0, 1.0, 1.0) and not c.get_hatch()
    ]
    assert len(white) == config.pipefusion * config.patches
    assert not legibility_problems(fig), legibility_problems(fig)


def test_deviation_text_hides_only_the_rounding():
    """Lessons and the explorer print a deviation from serial: under the floor (float32 rounding,
    machine-dependent digits) as '< 1e-5', at or above it with two significant figures."""
    from xdit_lab.lab.measure import deviation_text

    assert deviation_text(3.2e-7) == "< 1e-5"
    assert deviation_text(1e-5) == "1.0e-05"
    assert deviation_text(2.34e-3) == "2.3e-03"
    assert deviation_text(5e-5, floor=1e-4) == "< 1e-4"


def test_every_notebook_figure_is_a_package_view():
    """One style for every figure: the tutorials and notebooks draw only through the package's views
    (each checked for legibility in these tests), never with pyplot of their own."""
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    drawing = ("plt.subplots", "plt.figure", "plt.plot", "plt.imshow", "plt.bar", ".add_subplot(", "plt.show")
    found = []
    for path in sorted([*root.glob("tutorials/*.ipynb"), *root.glob("notebooks/*.ipynb")]):
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = "".join(cell["source"]) if cell["cell_type"] == "code" else ""
            found += [f"{path.name} cell {index}: {call}" for call in drawing if call in source]
    assert not found, found
