"""Sequence shards: the image tokens cut into one contiguous shard per sequence-parallel rank.

The sp group is ring × ulysses (ulysses varying fastest). Each rank holds x[B, S/sp, C] through
every block; attention sees the whole sequence through sp_attention (Ulysses, Ring or both), and
the tokens are gathered once, before unpatchify:

    embedding x[B, S, C] --keep shard--> x[B, S/sp, C] --blocks, sp_attention--> x[B, S/sp, C]
                         --all-gather (sp)--> x[B, S, C] --unpatchify--> the model's output

Text tokens of joint attention (SD3, Flux, CogVideoX) stay whole on every rank: they are split
off q, k, v here and handed to sp_attention as joint tokens.
"""

from __future__ import annotations

import torch

from .. import comm
from ..attention import sp_attention
from ..mesh import RING, SP, ULYSSES
from ..sharding import shard_range, shard_sizes
from .hooks import join_text, refuse_unsplittable, split_text
from .step import whole_step


class SequenceShards:
    """The token strategy of ulysses, ring and their hybrid (and of a single rank)."""

    def __init__(self, state):
        self.state, self.mesh = state, state.mesh
        self.shard_range = None  # (start, stop) of this rank's image tokens in the last forward

    def forward(self, run, bound):
        """One pass of the model's forward. An argument with one row per image token (CogVideoX's
        rotary tables, Flux.2's img_ids) keeps this rank's rows before the forward sees it."""
        kwarg = self.state.adapter.image_rows_kwarg
        rows = bound.arguments.get(kwarg) if kwarg else None
        if self.mesh.group_size(SP) > 1:
            refuse_unsplittable(bound.arguments)
        if isinstance(rows, tuple):
            bound.arguments[kwarg] = tuple(self._take_image_shard(t, dim=t.dim() - 2) for t in rows)
        elif rows is not None:
            bound.arguments[kwarg] = self._take_image_shard(rows, dim=rows.dim() - 2)
        return run()

    def reset(self) -> None:
        """A new generation: nothing carries over between steps."""

    # ---- what the rank keeps and holds: the questions every token strategy answers ------------------
    hands_text = False  # nothing is handed on between stages

    def run_step(self, session, t) -> None:
        """One denoising step of `session`: one transformer call (models/step.py)."""
        whole_step(session, t)

    def planned_kept_bytes(self, transformer, rows: int, grid: tuple[int, int]) -> dict[str, int]:
        """What this rank keeps between steps beside the latents and conditioning: nothing."""
        return {}

    def kept_bytes(self) -> dict[str, int]:
        return {}

    def token_pieces(self, rows: int, cols: int) -> dict:
        """The image tokens this rank computes for a rows × cols token grid: one contiguous shard (the
        last forward's, when it had this many tokens, else computed the same way)."""
        sp, sp_rank = self.mesh.group_size(SP), self.mesh.group_rank(SP)
        recorded = self.shard_range is not None and self.state.image_len == rows * cols
        start, stop = self.shard_range if recorded else shard_range(rows * cols, sp, sp_rank)
        return dict(
            sp_size=sp,
            sp_rank=sp_rank,
            tokens=[[start, stop]],
            pipefusion=None,
            source="SequenceShards.shard_range" if recorded else "computed (no forward yet)",
        )

    def staleness(self):
        return None

    decides_before_blocks = False  # a StepCache decides when the first block returns

    def token_patches(self, tokens: int) -> list[tuple[int, int]]:
        """(patch, tokens) of this rank's tokens in the running forward: one patch, its shard."""
        return [(0, tokens)]

    # ---- the hooks -----------------------------------------------------------------------------------
    def shard(self, tokens):
        adapter = self.state.adapter
        if adapter.text_before_image_at_shard:  # CogVideoX embeds [text; image] in one tensor
            text = self.state.text_len
            return torch.cat([tokens[:, :text], self._take_image_shard(tokens[:, text:])], dim=1)
        if adapter.grid_at_shard:  # Wan: [B, C, F, H, W] -> this rank's [B, C, S/sp], which the
            return self._take_image_shard(tokens.flatten(2), dim=2)  # forward's own flatten(2) leaves as it is
        return self._take_image_shard(tokens)

    def shard_rotary(self, tables):
        """This rank's rows of the rotary tables (the adapter's RotaryLayout.keep_rows). Wan's are
        computed before the tokens are sharded: the shard is taken from the table's own length."""
        return self.state.adapter.rotary.keep_rows(tables, self.state.text_len, self._take_image_shard)

    def gather(self, tokens):
        sizes = shard_sizes(self.state.image_len, self.mesh.group_size(SP))
        return comm.all_gather(tokens.contiguous(), self.mesh, SP, dim=1, sizes=sizes, tag="tokens")

    def attend(self, kind, name, query, key, value, scale, text, image_len, text_mask=None):
        (q, k, v), joint = split_text(kind, text, query, key, value)
        if joint is None:
            return sp_attention(q, k, v, self.mesh, seq_len=image_len, scale=scale)
        jq, jk, jv = joint
        out, joint_out = sp_attention(
            q, k, v, self.mesh, joint_q=jq, joint_k=jk, joint_v=jv, joint_mask=text_mask, seq_len=image_len, scale=scale
        )
        return join_text(kind, out, joint_out)

    def _take_image_shard(self, tokens: torch.Tensor, dim: int = 1) -> torch.Tensor:
        sp, total = self.mesh.group_size(SP), tokens.shape[dim]
        if total < sp:
            raise ValueError(
                f"{total} image tokens cannot be split over {sp} sequence-parallel ranks "
                f"(ulysses {self.mesh.group_size(ULYSSES)} × ring {self.mesh.group_size(RING)}); "
                f"use a larger image or a smaller degree"
            )
        self.state.image_len = total
        self.shard_range = shard_range(total, sp, self.mesh.group_rank(SP))
        return tokens.narrow(dim, self.shard_range[0], self.shard_range[1] - self.shard_range[0])
