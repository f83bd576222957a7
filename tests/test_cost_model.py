"""The cost model's work per rank equals the work the ranks really do, and its traffic the bytes
the sequence-parallel groups really send.

`ParallelConfig.cost().work_fraction` claims how many single-image transformer forwards the
busiest rank runs per denoising step. Here the ranks count them: a hook on every transformer block
adds up rows × image tokens entering it, and one forward of one image through the whole model is
image tokens × layers. One spawned run on 4 ranks covers every degree (and a few hybrids), with
guidance on and off, for 1 and 3 prompts; configurations smaller than 4 ranks leave the rest idle.
The same run records the bytes each rank sent per step in the ulysses and ring groups.
"""

import pytest

from xdit_lab import ParallelConfig, load_pipeline
from xdit_lab.digits.components import prompt_for
from xdit_lab.testing import run_on_ranks

CONFIGS = [
    ParallelConfig(dp=2),
    ParallelConfig(cfg=2),
    ParallelConfig(ulysses=2),
    ParallelConfig(ring=2),
    ParallelConfig(pipefusion=2),
    ParallelConfig(dp=4),
    ParallelConfig(ulysses=4),
    ParallelConfig(pipefusion=4),
    ParallelConfig(cfg=2, dp=2),
    ParallelConfig(dp=2, ulysses=2),
    ParallelConfig(cfg=2, pipefusion=2),
    ParallelConfig(pipefusion=2, ring=2),
    ParallelConfig(ring=4),
    ParallelConfig(ring=2, ulysses=2),
]
CALLS = [(guidance, batch) for guidance in (2.0, 1.0) for batch in (1, 3)]
STEPS = 2  # with PipeFusion's one warmup step: one whole-image step, then one patch at a time


def _count_forwards(configs, calls):
    """On every rank: per (config, guidance, batch), single-image forwards of this rank per step, and
    the bytes it sent per step in the ulysses and ring groups."""
    counted, sent = {}, {}
    for config in configs:
        pipe = load_pipeline("digits", config, progress=False)
        if not pipe.active:
            continue
        transformer = pipe.diffusers_pipeline.transformer
        tokens = [0]

        def count(_module, args, kwargs, tokens=tokens):
            hidden = args[0] if args else kwargs["hidden_states"]
            tokens[0] += hidden.shape[0] * hidden.shape[1]

        hooks = [block.register_forward_pre_hook(count, with_kwargs=True) for block in transformer.transformer_blocks]
        layers, image_tokens = transformer.config.num_layers, 64  # 8 × 8 tokens at the folder's 16 pixels
        for guidance, batch in calls:
            if config.cfg == 2 and guidance <= 1:
                continue  # refused: there is no second branch to split
            session = pipe.session(
                [prompt_for(d) for d in range(batch)], seed=0, guidance_scale=guidance, num_inference_steps=STEPS
            )
            per_step = []
            for _ in range(STEPS):
                tokens[0] = 0
                session.step()
                per_step.append(tokens[0] / (image_tokens * layers))
            counted[(config.short(), guidance, batch)] = per_step
            sent[(config.short(), guidance, batch)] = [
                sum(n for group, n in step.items() if group in ("ulysses", "ring")) for step in session.comm_per_step
            ]
        for hook in hooks:
            hook.remove()
        del pipe
    return counted, sent


@pytest.mark.timeout(720)
def test_cost_model_work_equals_the_forwards_counted_on_the_ranks(one_thread):
    answers = run_on_ranks(_count_forwards, 4, CONFIGS, CALLS, timeout_s=600)
    ranks, sent = [counted for counted, _ in answers], [bytes_sent for _, bytes_sent in answers]
    checked = 0
    for config in CONFIGS:
        for guidance, batch in CALLS:
            key = (config.short(), guidance, batch)
            counts = [rank[key] for rank in ranks if key in rank]
            if config.cfg == 2 and guidance <= 1:
                assert not counts
                continue
            assert len(counts) == config.world_size, key
            busiest = max(max(per_step) for per_step in counts)
            assert all(per_step[0] == per_step[1] for per_step in counts), (key, counts)  # warmup or not
            claimed = config.cost(4, batch=batch, use_cfg=guidance > 1).work_fraction
            assert busiest == claimed, f"{key}: ranks run {busiest} forwards per step, the cost model says {claimed}"
            if config.pipefusion == 1 and config.sp_degree > 1:  # its traffic: the attention's all-to-alls and hops
                most = max(max(rank[key]) for rank in sent if key in rank)
                planned = config.cost(4, batch=batch, use_cfg=guidance > 1).comm_bytes(64, 128, dtype_bytes=4)
                assert most == planned, f"{key}: the busiest rank sent {most} B per step, the cost model says {planned}"
            checked += 1
    assert checked == len(CONFIGS) * len(CALLS) - 2 * sum(c.cfg == 2 for c in CONFIGS)


def test_dp_with_guidance_at_batch_one_costs_what_cfg_costs():
    """The case the cost model got wrong: dp 2 splits the doubled batch [uncond; cond]."""
    dp, cfg = ParallelConfig(dp=2).cost(4, batch=1), ParallelConfig(cfg=2).cost(4, batch=1)
    assert dp.work_fraction == cfg.work_fraction == 1
    ranked = [c.short() for c in ParallelConfig.options(2, num_heads=4, num_layers=4)]
    assert ranked.index("dp2") < ranked.index("pf2")


@pytest.mark.parametrize("config", [ParallelConfig(tp=2), ParallelConfig(ulysses=2, tp=2)], ids=lambda c: c.short())
def test_the_cost_model_s_tp_term_is_the_traffic_model_s_with_the_text(config):
    """The cost model's tp term is tp_bytes_per_forward, the exact model's closed form (config.py holds it, traffic.py
    reuses it), over a rank's image and text tokens: for blocks whose two rowwise layers run on [text; image], its
    p·hs times p·hs·e is the bytes expected_bytes_per_step gives the tp group, on every rank. Control: the image's
    tokens alone (text_tokens=0, the cost model's term until now) fall short of them."""
    from xdit_lab.traffic import expected_bytes_per_step

    rows, cols, text, heads, head_dim, layers, e = 8, 8, 16, 4, 8, 3, 2
    hidden = heads * head_dim
    shapes = dict(
        batch=2, rows=rows, cols=cols, heads=heads, head_dim=head_dim, text_len=text, self_layers=0,
        joint_layers=layers, first_block_self_layers=0, first_block_joint_layers=1, proj_width=4, dtype_bytes=e,
        tp=dict(rowwise=[["joint", hidden, True, False]] * 2 * layers, gathered=[], norms=[]),
    )  # fmt: skip

    def tp_term(text_tokens):  # the cost model's elements of tp alone: its Ulysses part is 1/tp of ulysses alone's
        cost = config.cost(layers, num_heads=heads, text_tokens=text_tokens).comm_p_hs
        return cost - config.replace(tp=1).cost(layers, num_heads=heads).comm_p_hs / config.tp

    for ulysses_rank in range(config.ulysses):
        coords = dict(dp=0, cfg=0, pipefusion=0, ring=0, ulysses=ulysses_rank, tp=0)
        sent = expected_bytes_per_step(config, shapes, coords=coords)["tp"]
        assert tp_term(text / (rows * cols)) * rows * cols * hidden * e == pytest.approx(sent, rel=1e-12)
        assert tp_term(0) * rows * cols * hidden * e < 0.9 * sent  # the control: the text left out
