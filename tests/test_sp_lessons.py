"""The sequence-parallel lesson demos (xdit_lab/lessons/sequence.py) on 4 real gloo ranks, and the link model.

One 4-rank run makes every demo (ulysses 2 leaves ranks 2 and 3 idle); the checks are facts that
can fail: who holds which (token, head), which K/V block sits where at each ring step, the error
after each LSE merge, bytes against hand-written sizes."""

import pytest
from matplotlib.figure import Figure

from xdit_lab import ParallelConfig
from xdit_lab.lab.measure import bytes_match
from xdit_lab.lab.views import legibility_problems
from xdit_lab.lessons import links
from xdit_lab.lessons import sequence as sp
from xdit_lab.testing import run_on_ranks

ULYSSES2, RING4, USP = ParallelConfig(ulysses=2), ParallelConfig(ring=4), ParallelConfig(ulysses=2, ring=2)


def _demos():
    return dict(
        ulysses2=sp.ulysses_exchange({}, ULYSSES2, tokens=8, heads=4),
        usp_exchange=sp.ulysses_exchange({}, USP, tokens=8, heads=4),
        ring4=sp.ring_passes({}, RING4, tokens=16, heads=2, head_dim=8),
        ring4_zero=sp.ring_passes({}, RING4, tokens=16, heads=2, head_dim=8, zero_lse=True),
        usp_ring=sp.ring_passes({}, USP, tokens=16, heads=4, head_dim=8),
    )


@pytest.fixture(scope="module")
def demos():
    per_rank = run_on_ranks(_demos, 4, timeout_s=120)
    return {name: [rank[name] for rank in per_rank] for name in per_rank[0]}


def test_ulysses_exchange_trades_tokens_for_heads(demos):
    results = demos["ulysses2"]
    assert results[2] is None and results[3] is None  # idle outside the 2-rank configuration
    r0, r1 = results[:2]
    assert r0["before"] == [[t, h] for t in range(4) for h in range(4)]
    assert sorted({t for t, _ in r1["before"]}) == [4, 5, 6, 7]
    assert sorted({t for t, _ in r0["after"]}) == list(range(8)) and sorted({h for _, h in r0["after"]}) == [0, 1]
    assert sorted({h for _, h in r1["after"]}) == [2, 3]
    assert r0["shape_before"] == [1, 4, 4, 2] and r0["shape_after"] == [1, 2, 8, 2]
    assert sp.exchange_check(results) == dict(before_once=True, after_once=True, after_whole_rows=True, round_trip=True)
    # two all-to-alls of x[1, 4, 4, 2] float32 (128 B), half of each leaving the rank
    assert r0["all_to_alls"] == 2 and r0["bytes_out"] == {"ulysses": 128}
    fig = sp.draw_ulysses_exchange(results)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    assert not legibility_problems(fig), legibility_problems(fig)


def test_ulysses_inside_ring_gathers_the_ring_block(demos):
    results = demos["usp_exchange"]  # ranks 0, 1 share ring block tokens 0–3; ranks 2, 3 tokens 4–7
    assert [sorted({t for t, _ in r["after"]}) for r in results] == [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2
    assert [sorted({h for _, h in r["after"]}) for r in results] == [[0, 1], [2, 3]] * 2
    assert all(sp.exchange_check(results).values())
    fig = sp.draw_ulysses_exchange(results)  # four ranks: two a row, so it fits a notebook unscaled
    assert sum(ax.get_visible() for ax in fig.axes) == 8
    assert not legibility_problems(fig), legibility_problems(fig)
    fig = sp.draw_ulysses_exchange(results[:3])  # an odd count: the last pair's empty panels hidden
    assert sum(ax.get_visible() for ax in fig.axes) == 6
    assert not legibility_problems(fig), legibility_problems(fig)


def test_ring_schedule_and_merge_errors(demos):
    results, zero = demos["ring4"], demos["ring4_zero"]
    for r in results:  # step t: the block that started t ranks back
        assert [s["block"] for s in r["steps"]] == [(r["rank"] - t) % 4 for t in range(4)]
        assert r["steps"][1]["tokens"] == [4 * ((r["rank"] - 1) % 4), 4 * ((r["rank"] - 1) % 4) + 4]
        errors = [s["error"] for s in r["steps"]]
        assert errors[0] > 1e-2 and errors[-1] < 1e-5 and r["final_error"] < 1e-5
        assert r["sends"] == 3 and r["bytes_out"] == {"ring": 3 * 2 * 2 * 4 * 8 * 4}  # 3 × K,V [1, 2, 4, 8] fp32
    assert all(r["final_error"] > 1e-2 for r in zero)  # a zero LSE weighs every block alike: wrong
    schedule, merges = sp.draw_ring_schedule(results), sp.draw_merge_errors(results, zero)
    assert not legibility_problems(schedule) and not legibility_problems(merges)
    lines = merges.axes[0].lines
    assert len([line for line in lines if line.get_label().startswith("rank")]) == 8  # 4 ranks × 2 runs


def test_ring_under_usp_passes_head_split_blocks(demos):
    results = demos["usp_ring"]
    assert [[s["origin_rank"] for s in r["steps"]] for r in results] == [[0, 2], [1, 3], [2, 0], [3, 1]]
    assert all(r["final_error"] < 1e-5 and set(r["bytes_out"]) == {"ulysses", "ring"} for r in results)


def _summary(rank, measured, expected):
    return dict(rank=rank, step=2, num_steps=20, comm=dict(measured=[{}, measured], expected=[{}, expected]))


def test_bytes_match():
    good = [_summary(0, {"ring": 10, "sp": 4}, {"ring": 10, "sp": 4}), _summary(1, {"ring": 10}, {"ring": 10})]
    assert bytes_match(good) is True
    assert bytes_match([_summary(0, {"ring": 10}, {"ring": 12})]) is False


def test_bytes_at_a_pixart_size_and_link_times():
    shapes = links.dit_shapes()  # 4096 tokens, 16 heads × 72, 28 layers, batch 2, 2-byte elements
    assert (shapes["rows"], shapes["cols"], shapes["head_dim"]) == (64, 64, 72)
    per_layer = 2 * 1024 * 1152 * 2  # one rank's shard of one tensor, bytes: batch 2 × 1024 tokens × hidden
    u4 = links.bytes_per_rank(ParallelConfig(ulysses=4), shapes)
    assert u4[0]["ulysses"] == 28 * 4 * per_layer * 3 // 4  # q, k, v, o; 3/4 of each leaves
    r4 = links.bytes_per_rank(ParallelConfig(ring=4), shapes)
    assert r4[0]["ring"] == 28 * 3 * 2 * per_layer  # K and V, three hops
    fast, slow = 300e9, 25e9
    one_box = links.comm_seconds(
        ParallelConfig(ulysses=4), u4, ranks_per_node=4, fast_bytes_per_s=fast, slow_bytes_per_s=slow
    )
    assert one_box["links"] == {"ulysses": "fast", "sp": "fast"}
    assert one_box["groups"]["ulysses"] == pytest.approx(u4[0]["ulysses"] / fast)
    usp = ParallelConfig(ulysses=2, ring=2)
    two_boxes = links.comm_seconds(
        usp, links.bytes_per_rank(usp, shapes), ranks_per_node=2, fast_bytes_per_s=fast, slow_bytes_per_s=slow
    )
    assert two_boxes["links"] == {"ulysses": "fast", "ring": "slow", "sp": "mixed"}  # ulysses varies fastest
    spread = links.comm_seconds(
        ParallelConfig(ulysses=4), u4, ranks_per_node=2, fast_bytes_per_s=fast, slow_bytes_per_s=slow
    )
    assert spread["groups"]["ulysses"] == pytest.approx(u4[0]["ulysses"] * 2 / 3 / slow)  # 2 of 3 peers far
    rows = links.link_rows(
        [ParallelConfig(ulysses=4), ParallelConfig(ring=4), usp],
        shapes,
        {
            "one box": dict(ranks_per_node=4, fast_bytes_per_s=fast, slow_bytes_per_s=slow),
            "two boxes": dict(ranks_per_node=2, fast_bytes_per_s=fast, slow_bytes_per_s=slow),
        },
    )
    assert [r["config"] for r in rows] == ["ulysses4", "ring4", "ring2·ulysses2"] * 2
    text = links.link_table(rows)
    assert text.count("<- least") == 2
    assert len(links.draw_link_times(rows).axes) == 2
    assert not legibility_problems(links.draw_link_times(rows)), legibility_problems(links.draw_link_times(rows))
    three = links.link_rows(  # tutorial 04's three scenarios: two panels a row
        [ParallelConfig(ulysses=4), usp],
        shapes,
        {f"{n} a box": dict(ranks_per_node=n, fast_bytes_per_s=fast, slow_bytes_per_s=slow) for n in (4, 2, 1)},
    )
    fig = links.draw_link_times(three)
    assert sum(ax.get_visible() for ax in fig.axes) == 3
    assert not legibility_problems(fig), legibility_problems(fig)


def test_link_model_with_compute_and_latency():
    """Per-call latency adds calls × latency; compute is the rank's share of the forward's FLOPs; a
    step with Ring's hops hidden lies between the bound max(compute, comm) and the sum."""
    shapes = links.dit_shapes()
    u4, r4 = ParallelConfig(ulysses=4), ParallelConfig(ring=4)
    assert links.collective_calls(u4, shapes)["ulysses"] == 2 * 28  # q, k, v together, then the output
    assert links.collective_calls(r4, shapes)["ring"] == 3 * 28  # three hops per layer
    bytes_u4 = links.bytes_per_rank(u4, shapes)
    link = dict(ranks_per_node=4, fast_bytes_per_s=300e9, slow_bytes_per_s=25e9)
    plain = links.comm_seconds(u4, bytes_u4, **link)
    slow = links.comm_seconds(u4, bytes_u4, latency_s=1e-5, calls=links.collective_calls(u4, shapes), **link)
    assert slow["groups"]["ulysses"] - plain["groups"]["ulysses"] == pytest.approx(56 * 1e-5)
    assert slow["groups"]["sp"] - plain["groups"]["sp"] == pytest.approx(1e-5)  # one gather per step
    per_branch = 28 * 4096 * (24 * 1152**2 + 4 * 4096 * 1152)  # FLOPs, by hand
    # 2 branches (one prompt with guidance) over 4 sequence shards: half a branch per rank
    assert links.compute_seconds(u4, shapes, 400e12) == pytest.approx(0.5 * per_branch / 400e12)
    scenarios = {"one box": dict(link, latency_s=1e-5, flops_per_s=400e12)}
    rows = links.link_rows([u4, r4], shapes, scenarios)
    for row in rows:
        assert row["bound"] <= row["ring_hidden"] <= row["no_overlap"]
    assert rows[0]["ring_hidden"] == rows[0]["no_overlap"]  # Ulysses: nothing hides
    assert rows[1]["ring_hidden"] < rows[1]["no_overlap"]  # Ring: its hops under the attention
    assert links.link_table(rows).count("<- fastest step") == 1


def test_an_exercise_check_tells_right_from_wrong():
    from xdit_lab.lessons.exercises import check

    assert check(None, 1_310_720, solution="4 × ...").startswith("no answer yet")
    assert "Solution: 4 × ..." in check(None, 1_310_720, solution="4 × ...")
    assert check(1_310_720, 1_310_720, solution="").startswith("right")
    assert check(1_310_720.0, 1_310_720, solution="").startswith("right")  # a float of the same value
    assert check(2_621_440, 1_310_720, solution="").startswith("not yet")  # the 10-prompt figure
    assert check([1, 2, 4], [1, 2, 4], solution="").startswith("right")
    assert check([1, 2, 3, 4], [1, 2, 4], solution="").startswith("not yet")
    assert check(True, 1, solution="").startswith("not yet")  # True is not the number 1 here
    assert check("1/5", 0.2, solution="").startswith("not yet")  # a fraction as text is not a number
    # with a hint, the solution waits for a right answer
    for wrong in (None, 2_621_440):
        said = check(wrong, 1_310_720, solution="4 × ...", hint="count the rows")
        assert "count the rows" in said and "4 × ..." not in said and "1310720" not in said, said
    assert "Solution: 4 × ..." in check(1_310_720, 1_310_720, solution="4 × ...", hint="count the rows")


def test_the_ulysses_bytes_exercise_says_its_working_only_to_a_right_answer():
    """Tutorial 02's exercise 2 asks for the bytes one rank sends per step for 5 prompts: its check compares the
    answer with what the ranks measured, and neither a wrong answer nor none yet is shown the working (it printed
    it before), nor the number. The working is the measured closed form: two all-to-alls per layer, four tensors."""
    value, working = sp.ulysses_bytes_solution(5)
    assert value == 1_310_720 and working.endswith("= 1,310,720") and working.startswith("4 tensors")
    assert sp.ulysses_bytes_solution(10)[0] == 2_621_440  # the 10-prompt figure the tutorial measures
    measured = {0: 1_310_720, 1: 1_310_720}
    for wrong in (None, 2_621_440, 655_360, "1,310,720"):
        said = sp.ulysses_bytes_exercise(wrong, measured, 5)
        assert "Hint: " in said and working not in said and "×" not in said, said
        assert "1,310,720" not in said.replace("'1,310,720'", "") and "1310720" not in said, said
    right = sp.ulysses_bytes_exercise(1_310_720, measured, 5)
    assert right.startswith("right: 1310720") and working in right
    with pytest.raises(AssertionError, match="not what the ranks sent"):  # a stale working fails the notebook
        sp.ulysses_bytes_exercise(1_310_720, {0: 2_621_440, 1: 2_621_440}, 5)
