"""Arguments with one entry per image token follow the tokens' shard (families/adapter.py PerToken), against
diffusers' serial forward:

    Wan 2.2 TI2V     timestep [B, S], one per token, at the forward       ulysses, ring, usp, pipefusion, cfg
    Qwen-Image-Edit  modulate_index [B, S] (zero_cond_t), at every block   ulysses, ring, usp, pipefusion, cfg
    HunyuanVideo I2V num_tokens (token_replace), the frame-0 count         ulysses, ring, usp, pipefusion, cfg
    Flux ControlNet  controlnet_block_samples, controlnet_single_block_samples: [B, S, D] per block fed
    SD3 ControlNet   block_controlnet_hidden_states: [B, S, D] per block fed     (both: ulysses, ring, usp, cfg, dp)

Each case's per-token values differ from token to token (random timesteps; a target image and a reference;
a first frame and a second), so a rank that took another rank's entries would compute something else. The
control runs that wrong variant on a fresh model: the strategy keeps the mirrored entries (a tensor) or the
whole count (the frame-0 count uncut), and its error must exceed the bound. (Under PipeFusion alone a rank
holds every token in the exact, warmup, step: the uncut count is then the right one, and the count is
checked where ranks split the patches, pf2·ring2.) Every degree above 1 moves exactly its closed
form (tests/forward_traffic.py).
"""

import pytest
import torch
from forward_traffic import traffic_row

from xdit_lab import ParallelConfig, RankMesh, comm_log, parallelize
from xdit_lab.models import parallel_state
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

CASES = {  # family -> the configs it runs under, on 2 and on 4 ranks
    "wan": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(pipefusion=2), ParallelConfig(cfg=2)],
        4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(pipefusion=2, ulysses=2)],
    },
    # several images per sample: PipeFusion's patch i is band i of each (the reference's 2 rows, 1 a patch)
    "qwenimage": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(pipefusion=2), ParallelConfig(cfg=2)],
        4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(dp=2, ulysses=2), ParallelConfig(pipefusion=2, ring=2)],
    },
    "hunyuanvideo": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(pipefusion=2), ParallelConfig(dp=2)],
        4: [ParallelConfig(ulysses=2, ring=2), ParallelConfig(pipefusion=2, ring=2)],
    },
    # a ControlNet's residuals (PipeFusion refuses them by name: they index the whole model's blocks)
    "flux": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(dp=2)],
        4: [ParallelConfig(ulysses=2, ring=2)],
    },
    "sd3": {
        2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2), ParallelConfig(cfg=2)],
        4: [ParallelConfig(ulysses=2, ring=2)],
    },
}
TOKENS = {"qwenimage": (16, 4)}  # a target image of 4 × 4 tokens and a reference of 2 × 2


def _case(family):
    """The tiny model with its per-token conditioning on, and inputs whose per-token values vary."""
    g = torch.Generator().manual_seed(5)
    if family == "wan":  # 2 latent frames of 4 × 4 tokens: a timestep each, as Wan 2.2 TI2V's pipeline gives
        inputs = tiny_inputs("wan", 2)
        return tiny_transformer("wan", seed=0), inputs | {"timestep": torch.rand(2, 32, generator=g) * 1000}
    if family == "qwenimage":  # zero_cond_t: the reference's tokens are modulated at t = 0
        target, reference = TOKENS["qwenimage"]
        inputs = tiny_inputs("qwenimage", 2) | {
            "hidden_states": torch.randn(2, target + reference, 16, generator=g),
            "img_shapes": [[(1, 4, 4), (1, 2, 2)]] * 2,
        }
        return tiny_transformer("qwenimage", seed=0, zero_cond_t=True), inputs
    if family in ("flux", "sd3"):  # a ControlNet's residuals, random, for every block (Flux: both kinds)
        model, inputs = tiny_transformer(family, seed=0), tiny_inputs(family, 2)
        hidden = inputs["hidden_states"]
        tokens = (
            hidden.shape[1] if hidden.dim() == 3 else hidden.shape[-2] * hidden.shape[-1] // 4
        )  # SD3: 2 × 2 patches
        residuals = lambda n: [torch.randn(2, tokens, model.inner_dim, generator=g) for _ in range(n)]  # noqa: E731
        if family == "sd3":
            return model, inputs | {"block_controlnet_hidden_states": residuals(len(model.transformer_blocks))}
        return model, inputs | {
            "controlnet_block_samples": residuals(len(model.transformer_blocks)),
            "controlnet_single_block_samples": residuals(len(model.single_transformer_blocks)),
        }
    # token replace: the first of 2 frames (16 of 32 tokens) modulated at t = 0
    return tiny_transformer("hunyuanvideo", seed=0, image_condition_type="token_replace"), tiny_inputs(
        "hunyuanvideo", 2
    )


def _wrong(strategy):
    """The control: the strategy keeps other tokens' entries (mirrored) and leaves a frame-0 count uncut."""
    keep_tokens = strategy.keep_tokens
    strategy.keep_tokens = lambda tensor, dim: keep_tokens(tensor.flip(dim), dim)
    strategy.keep_prefix = lambda count: count


def _compare(cases):
    rows = []
    for family, config in cases:
        model, inputs = _case(family)
        with torch.no_grad():
            reference = model(**inputs).sample
        mesh = RankMesh(config)
        model = parallelize(model, config, mesh)
        with torch.no_grad(), comm_log() as log:
            output = model(**inputs).sample
        traffic = traffic_row(model, inputs, log, step=0)
        control = None
        if config.sp_degree > 1 or (config.pipefusion > 1 and family != "hunyuanvideo"):
            wrong = parallelize(_case(family)[0], config, mesh)
            _wrong(parallel_state(wrong).strategy)
            with torch.no_grad():
                control = (wrong(**inputs).sample - reference).abs().max().item()
        rows.append(
            dict(
                where=f"{family} {config.short()}",
                error=(output - reference).abs().max().item(),
                bound=1e-4 * max(1.0, reference.abs().max().item()),
                control=control,
                **traffic,
            )
        )
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
def test_per_token_arguments_follow_the_shard_exactly(world_size):
    cases = [(family, config) for family, configs in CASES.items() for config in configs[world_size]]
    for rank, rows in enumerate(run_on_ranks(_compare, world_size, cases, timeout_s=300)):
        assert len(rows) == len(cases)
        for row in rows:
            where = f"{row['where']} rank {rank}"
            assert row["error"] <= row["bound"], f"{where}: error {row['error']:.3g} > {row['bound']:.3g}"
            assert row["moved"] == row["expected"], f"{where}: moved {row['moved']}, closed form {row['expected']}"
            assert row["moved"], where  # every degree above 1 moved something
            if row["control"] is not None:
                assert row["control"] > 10 * row["bound"], f"{where}: the wrong entries give {row['control']:.3g}"
