"""xdit_lab.lessons.fitting: the helpers of tutorial 14 (fitting a big model).

- chunk_rows against torch.chunk itself; header_shares (the headers alone) against the shards torch's
  FSDP2 gave four real ranks, and against an even split (the control, which must miss);
- on four gloo ranks with the digits model sharded (load_pipeline(shard_weights=True)): what a rank holds
  equals the load's plan on the busiest rank, the "weights" gathers recorded in a step equal (N-1) × the
  padded shards of the FSDP2 units and the package's closed form (weight_gather_bytes), every rank sends
  as much as rank 0 though rank 3 holds less, only the running block and the root are whole while a block
  runs, and the encode's gathers are two calls of the text encoder;
- on_disk against a sparse file and a dense one (the control); the plan's tables and figure for
  FLUX.1-dev from its header-only folder: the rows the lesson reads, legible, the bars summing to each row.
"""

import pytest
import torch

from xdit_lab import ParallelConfig
from xdit_lab.digits import DIGITS_DIR
from xdit_lab.lessons import fitting
from xdit_lab.testing import run_on_ranks

GB = 10**9


@pytest.mark.parametrize("rows, ranks", [(6, 4), (2, 4), (18, 4), (128, 4), (7, 3), (1, 2), (5, 8)])
def test_chunk_rows_are_torch_chunks(rows, ranks):
    pieces = [len(piece) for piece in torch.chunk(torch.arange(rows), ranks)]
    assert fitting.chunk_rows(rows, ranks) == pieces + [0] * (ranks - len(pieces))


def _sharded_digits(steps):
    """On each of 4 ranks: the digits pipeline under ulysses 4 with sharded weights; the lesson's helpers
    after one step (the encode with it) and during the next; the package's closed form of a step's
    gathers, from an unsharded transformer made on the meta device."""
    import torch.distributed as dist
    from diffusers import PixArtTransformer2DModel

    from xdit_lab.families import FAMILIES
    from xdit_lab.models.sharded_weights import weight_gather_bytes, weight_units
    from xdit_lab.pipeline import load_pipeline

    state = {"rank": dist.get_rank()}
    state["pipe"] = load_pipeline("digits", ParallelConfig(ulysses=4), progress=False, shard_weights=True)
    names = {"transformer": ["transformer_blocks.0.scale_shift_table", "pos_embed.proj.weight"]}
    sizes = fitting.held_shares(state, names)
    state["session"] = state["pipe"].session(["a handwritten 3", "a handwritten 7"], seed=0, num_inference_steps=steps)
    state["session"].step()
    gathers = fitting.step_gathers(state)
    with torch.device("meta"):
        unsharded = PixArtTransformer2DModel.from_config(
            PixArtTransformer2DModel.load_config(DIGITS_DIR / "transformer")
        )
    closed = weight_gather_bytes(weight_units(unsharded, FAMILIES["PixArtTransformer2DModel"].blocks(unsharded)), 4)
    return dict(
        sizes=sizes,
        gathers=gathers,
        held=fitting.held_and_planned(state),
        last=fitting.last_step_bytes(state),
        closed=closed,
    )


@pytest.fixture(scope="module")
def four_ranks():
    return run_on_ranks(_sharded_digits, 4, 3, timeout_s=300)


def test_a_rank_holds_the_rows_the_headers_give_it(four_ranks):
    measured = [rank["sizes"]["components"]["transformer"]["held"] for rank in four_ranks]
    assert measured == fitting.header_shares(DIGITS_DIR / "transformer", 4) == [1233296, 1233296, 1232784, 1228688]
    whole = four_ranks[0]["sizes"]["components"]["transformer"]["whole"]
    assert measured != [whole // 4] * 4  # the control: an even split is not what FSDP2 gives
    for rank, row in enumerate(four_ranks):
        assert (
            row["sizes"]["rows"]["transformer: transformer_blocks.0.scale_shift_table"]["rows"]
            == ([[0, 2], [2, 4], [4, 6], [6, 6]][rank])
        )
        assert row["sizes"]["rows"]["transformer: pos_embed.proj.weight"] == dict(
            shape=[128, 4, 2, 2], rows=[32 * rank, 32 * rank + 32]
        )
        assert row["sizes"]["components"]["vae"]["sharded"] == 0  # the VAE stays whole
        planned = row["held"]["planned"]
        assert all(row["held"]["held"][name] <= planned[name] for name in planned)
    assert four_ranks[0]["held"]["held"] == four_ranks[0]["held"]["planned"]  # the plan counts the busiest rank
    assert four_ranks[3]["held"]["held"]["transformer"] < four_ranks[3]["held"]["planned"]["transformer"]


def test_a_step_sends_n_minus_1_padded_shards_on_every_rank(four_ranks):
    for row in four_ranks:
        g = row["gathers"]
        sent = [n for _, n in g["gathers"]]
        assert {group for group, _ in g["gathers"]} == {"weights"} and g["group_size"] == 4
        assert sent == [3 * shard for _, shard in g["units"]]  # one gather per unit, in the units' order
        assert sum(sent) == row["closed"] == 3 * four_ranks[0]["sizes"]["components"]["transformer"]["held"]
        assert row["last"]["weights"] == sum(sent)  # the session's own record of the same step
        assert [name for name, _ in g["units"]] == ["(root)"] + [f"transformer_blocks.{i}" for i in range(4)]
        for block, whole in g["whole_while"].items():
            assert whole == ["(root)", block]  # the others are shards while a block runs
        encoder = sum(shard for _, shard in g["encoder_units"])
        assert g["encode"]["world"] == 2 * 3 * encoder  # prompts and negative prompts: two calls
    assert four_ranks[3]["sizes"]["components"]["transformer"]["held"] * 3 < four_ranks[3]["last"]["weights"]


def test_on_disk_counts_a_sparse_file_apart_from_a_dense_one(tmp_path):
    sparse = tmp_path / "sparse"
    sparse.mkdir()
    with open(sparse / "hole.bin", "wb") as f:
        f.seek(64 * 2**20)
        f.write(b"x")
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "data.bin").write_bytes(b"\1" * 2**20)
    holes, filled = fitting.on_disk(sparse), fitting.on_disk(dense)
    assert holes["apparent_bytes"] == 64 * 2**20 + 1 and holes["allocated_bytes"] < 2**20
    assert filled["apparent_bytes"] == 2**20 and filled["allocated_bytes"] >= 2**20  # the control


@pytest.fixture(scope="module")
def flux_rows(tmp_path_factory):
    from xdit_lab.plan import plan_model
    from xdit_lab.real_models import save_header_only

    folder = save_header_only("FLUX.1-dev", tmp_path_factory.mktemp("flux") / "FLUX.1-dev")
    return plan_model(folder, 4, 24 * GB)


def test_the_plans_rows_tables_and_figure(flux_rows):
    from xdit_lab.lab.views import legibility_problems

    chosen = [fitting.pick(flux_rows, "ulysses4", shard, text) for shard, text in [(False, "gpu"), (True, "sharded")]]
    assert not chosen[0].fits and chosen[1].fits and chosen[1].per_rank_bytes <= 12 * GB
    terms = fitting.terms_table(chosen).splitlines()
    assert len(terms) == 3 and terms[1].endswith(" no") and terms[2].endswith(" yes")
    traffic = fitting.traffic_table(chosen).splitlines()
    assert traffic[0].endswith("s/step NVLink  s/step PCIe") and "17.85" in traffic[2] and "0.00" in traffic[1]
    fig = fitting.draw_terms(chosen, 24 * GB)
    fig.canvas.draw()
    assert not legibility_problems(fig), legibility_problems(fig)
    (ax,) = fig.axes
    widths = [0.0] * len(chosen)
    for bar in ax.patches:
        widths[round(bar.get_y() + bar.get_height() / 2)] += bar.get_width()
    assert widths == pytest.approx([row.per_rank_bytes / GB for row in chosen])
    with pytest.raises(ValueError, match="ulysses4"):
        fitting.pick(flux_rows, "ulysses8", True, "gpu")
