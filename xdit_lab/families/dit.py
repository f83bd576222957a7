"""DiT: class-conditioned (no text), self-attention only; its output layer takes its conditioning from
block 0. No pipeline recipe: DiTPipeline ignores output_type="latent" and hard-codes its null class."""

from __future__ import annotations

from .adapter import FamilyAdapter
from .tiny_spec import TinySpec


def output_conditioning_from_block_0(transformer, block_0, hooks) -> None:
    """DiT's output layer takes its conditioning from `transformer_blocks[0].norm1.emb`, the model's
    block 0. On a later PipeFusion stage that list starts at another block, so once this stage's blocks
    have run, that call is answered by block 0's embedding, kept here (a few small layers). The hooks
    hold that embedding, not the transformer: no reference cycle keeps a replaced model alive. Each is
    installed in `hooks` (the model's parallel_state(...).hooks), by name."""
    block_0_emb = block_0.norm1.emb
    hooks.replace("dit.block_0_emb", transformer, _xdit_lab_block_0_emb=block_0_emb)  # a submodule: moves with it
    first, last = transformer.transformer_blocks[0], transformer.transformer_blocks[-1]
    blocks_done = [False]

    def entering(_module, _args):
        blocks_done[0] = False

    def leaving(_module, _args, _output):
        blocks_done[0] = True

    def output_conditioning(_module, args, kwargs, output):
        return block_0_emb(*args, **kwargs) if blocks_done[0] else output

    hooks.forward_pre_hook("dit.entering", first, entering)
    hooks.forward_hook("dit.leaving", last, leaving)
    hooks.forward_hook("dit.output_conditioning", first.norm1.emb, output_conditioning, with_kwargs=True)


ADAPTER = FamilyAdapter(
    "dit",
    "DiTTransformer2DModel",
    shard_at="pos_embed",
    gather_at="proj_out_2",
    attention={r"\.attn1$": "self"},
    output_conditioning=output_conditioning_from_block_0,
    called_outside_their_block=("transformer_blocks.0.norm1.emb",),
    # tensor parallelism (diffusers declares no _tp_plan for DiT): attention split by heads (no qk norm), the MLP
    # by width; each block's modulation [B, 6·dim] and the output's [B, 2·dim] (proj_out_1) split and gathered
    tp_plan={
        **{f"transformer_blocks.*.attn1.{p}": "colwise" for p in ("to_q", "to_k", "to_v")},
        "transformer_blocks.*.attn1.to_out.0": "rowwise",
        "transformer_blocks.*.ff.net.0.proj": "colwise",
        "transformer_blocks.*.ff.net.2": "rowwise",
    },
    tp_gathered=("transformer_blocks.*.norm1.linear", "proj_out_1"),
)

RECIPE = None  # no pipeline: the transformer runs under every strategy, its pipeline is not offered


def tiny_inputs(batch, height, width, text, timestep, randn):
    import torch

    return dict(
        hidden_states=randn(batch, 4, height, width), timestep=timestep.long(), class_labels=torch.arange(batch) % 10
    )


TINY = TinySpec(
    transformer=dict(in_channels=4, out_channels=8, sample_size=8, patch_size=2, num_embeds_ada_norm=10),
    inputs=tiny_inputs,
)
