"""Sequence shards: the image tokens, and the joint text beside them, cut into one contiguous shard per
sequence-parallel rank.

The sp group is ring × ulysses (ulysses varying fastest). Each rank holds x[B, S/sp, C] of the image
and, in joint families, t[B, T/sp, C] of the text through every block; attention sees the whole
sequence through sp_attention_sharded (Ulysses, Ring or both), where the text travels with the image
in the same all-to-all or Ring block; the image tokens are gathered once, before unpatchify:

    embedding x[B, S, C] --keep shard--> x[B, S/sp, C] --blocks, sp attention--> x[B, S/sp, C]
                         --all-gather (sp)--> x[B, S, C] --unpatchify--> the model's output
    text t[B, T, C]      --keep shard--> t[B, T/sp, C] --blocks--> (the model drops it after its blocks)

Where the text is cut is the family's (FamilyAdapter.text_shard_at): at the forward's input (Flux and
Flux.2: the text and its ids; SD3: the text), or as the first block takes it (Qwen-Image, HunyuanVideo,
CogVideoX: the forward needs the whole text before, for its rotary positions, its padding mask, or
its embedding of [text; image]; Z-Image: joined after the image in one tensor). Every linear layer of every block then runs on 1/sp of the text rows
too. A padded text's key mask stays whole on every rank (it is small); each attention reads the
columns of the text shards it attends. No family needs the whole text after its blocks: their
forwards return the image only (Flux.2 slices its joined [text; image] by the text length the
forward saw, the shard's).

`Controls(shards_text=False)`, given to parallelize, keeps the joint text whole on every rank, the
way before text was split: a control, deliberately more work per rank (tests/test_models.py counts
the rows).
"""

from __future__ import annotations

import torch

from .. import comm
from ..attention import sp_attention, sp_attention_sharded, whole_query_attention
from ..attention.linear import linear_sums, reduce_sums
from ..attention.wire import Wire
from ..mesh import RING, SP, ULYSSES
from ..sharding import shard_range, shard_sizes
from .hooks import join_text, keep_forward_per_token, refuse_unsplittable, split_text
from .row_halo import exchange_halo
from .step import whole_step
from .strategy import StrategyReport

JOINT_KINDS = ("joint_first", "joint_last")


class SequenceShards:
    """The token strategy of ulysses, ring and their hybrid (and of a single rank, where it splits
    nothing: no hook is installed, diffusers' forward runs as it is on this rank's batch rows)."""

    def __init__(self, state):
        self.state, self.mesh = state, state.mesh
        self.shard_range = None  # (start, stop) of this rank's image tokens in the last forward
        sp = self.mesh.group_size(SP)
        self.splits_tokens = self.takes_attention = sp > 1  # what the hooks install (models/hooks.py)
        joint = any(kind in JOINT_KINDS for kind in state.adapter.attention.values())
        # where this rank keeps its share of the joint text: "input", "block" (the adapter's), or None
        shards_text = state.controls.shards_text  # the control (False): joint text whole on every rank
        self.text_shard_at = state.adapter.text_shard_at if (shards_text and joint and sp > 1) else None
        # float8 on the attention exchanges (ParallelConfig.comm_dtype), None: the model's dtype
        self.wire = Wire.of(self.mesh.config.comm_dtype, state.controls.wrong_comm_scales)

    def forward(self, run, bound):
        """One pass of the model's forward. Its arguments with one entry per image token (adapter.per_token:
        CogVideoX's rotary tables, Flux.2's img_ids, Wan 2.2's timestep per token) keep this rank's entries
        before the forward sees them; where the family's text is cut at the input, the text and its rows
        (Flux's txt_ids) keep this rank's."""
        adapter = self.state.adapter
        if self.splits_tokens:
            refuse_unsplittable(bound.arguments)
            keep_forward_per_token(self.state, bound.arguments)
        if self.text_shard_at == "input" and self.splits_text():
            bound.arguments["encoder_hidden_states"] = self.shard_text(bound.arguments["encoder_hidden_states"])
            text_rows = bound.arguments.get(adapter.text_rows_kwarg) if adapter.text_rows_kwarg else None
            if text_rows is not None:
                bound.arguments[adapter.text_rows_kwarg] = self._take_text_shard(text_rows, dim=text_rows.dim() - 2)
        return run()

    def reset(self) -> None:
        """A new generation: nothing carries over between steps."""

    def run_step(self, context, t) -> None:
        """One denoising step (`context`: a StepContext): one transformer call (models/step.py)."""
        whole_step(context, t)

    # ---- what the views and the planner ask -----------------------------------------------------------
    def report(self, grid: tuple[int, int] | None = None, rows: int | None = None, appended=()) -> StrategyReport:
        """This rank's shard of a `grid` of tokens (and the `appended` grids of images after it: an edit's
        reference images); nothing is kept between steps, nothing handed on."""
        tokens = None if grid is None else self._token_pieces(grid[0] * grid[1] + sum(r * c for r, c in appended))
        return StrategyReport(kind="sequence shards", step=None, hands_text=False, kept_bytes={}, tokens=tokens)

    def _token_pieces(self, tokens: int) -> dict:
        """The image tokens this rank computes of a sequence of `tokens`: one contiguous shard (the last
        forward's, when it had this many tokens, else computed the same way)."""
        sp, sp_rank = self.mesh.group_size(SP), self.mesh.group_rank(SP)
        recorded = self.shard_range is not None and self.state.image_len == tokens
        start, stop = self.shard_range if recorded else shard_range(tokens, sp, sp_rank)
        if recorded:
            source = "SequenceShards.shard_range"
        elif sp == 1:  # no hook runs without sequence parallelism: every rank holds every token
            source = "whole (no sequence parallelism)"
        else:
            source = "computed (no forward yet)"
        return dict(sp_size=sp, sp_rank=sp_rank, tokens=[[start, stop]], pipefusion=None, source=source)

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
        """This rank's rows of the rotary tables (the adapter's RotaryLayout.keep_rows): its image rows
        and its text rows. Where the text was cut at the input, the tables were computed from the
        shard's own ids (their text rows are this rank's already); where it is cut at the first block,
        the tables cover the whole text and keep this rank's rows of it. Wan's are computed before the
        tokens are sharded: the shard is taken from the table's own length."""
        text, keep_text = self.state.text_len, None
        if self.text_shard_at == "input" and self.splits_text():
            text = self._text_sizes(text)[self.mesh.group_rank(SP)]
        elif self.text_shard_at == "block" and self.splits_text():
            keep_text = self._take_text_shard
        return self.state.adapter.rotary.keep_rows(tables, text, self._take_image_shard, keep_text)

    def keep_tokens(self, tensor, dim: int):
        """This rank's entries of a tensor with one per image token on `dim` (adapter.PerToken): its shard."""
        return self._take_image_shard(tensor, dim)

    def keep_prefix(self, count: int) -> int:
        """How many of this rank's image tokens are among the sequence's first `count` (adapter.PerToken)."""
        start, stop = self.shard_range
        return min(max(count - start, 0), stop - start)

    def shard_text(self, text):
        """This rank's tokens of the joint text states [B, T, C] (dim 1)."""
        return self._take_text_shard(text, dim=1) if self.splits_text() else text

    def splits_text(self, text_len: int | None = None) -> bool:
        """Whether a joint text of text_len tokens (this forward's when None) is split: where this
        strategy splits it, and when every sp rank gets a token of it (a text shorter than the sp degree
        stays whole: an empty shard would be read as "no text" by some processors, e.g. HunyuanVideo's
        `x[:, :-0]`). Attention passes the length it was given: under compile, what the forward wrote on
        the state reaches the attention operator only after the graph."""
        text_len = self.state.text_len if text_len is None else text_len
        return self.text_shard_at is not None and text_len >= self.mesh.group_size(SP)

    def gather(self, tokens):
        sizes = shard_sizes(self.state.image_len, self.mesh.group_size(SP))
        if self.state.adapter.text_after_image_at_gather:  # Z-Image's [image; text]: the image's tokens alone
            tokens = tokens[:, : self.shard_range[1] - self.shard_range[0]]
        return comm.all_gather(tokens.contiguous(), self.mesh, SP, dim=1, sizes=sizes, tag="tokens")

    def attend(self, kind, name, query, key, value, scale, text, image_len, text_mask=None):
        """Exact attention of this rank's tokens over every rank's, image and text: q, k, v [B, H, n, D]
        as the module holds them (its text shard before or after its image shard); "whole_queries": queries whole
        on every rank against this rank's image keys (LTX-2's audio asking the video)."""
        if kind == "whole_queries":
            if not self.state.controls.merges_whole_queries:  # the control: this rank's keys alone
                return sp_attention(query, key, value, self.mesh, scale=scale, kv_sharded=False)
            return whole_query_attention(query, key, value, self.mesh, scale=scale)
        image_sizes = shard_sizes(image_len, self.mesh.group_size(SP))
        joint = kind in JOINT_KINDS and text > 0
        if joint and not self.splits_text(text):  # the text whole on every rank (the control; a short text)
            (q, k, v), (jq, jk, jv) = split_text(kind, text, query, key, value)
            out, joint_out = sp_attention(
                q,
                k,
                v,
                self.mesh,
                joint_q=jq,
                joint_k=jk,
                joint_v=jv,
                joint_mask=text_mask,
                seq_len=image_len,
                scale=scale,
                wire=self.wire,
            )
            return join_text(kind, out, joint_out)
        return sp_attention_sharded(
            query,
            key,
            value,
            self.mesh,
            image_sizes,
            self._text_sizes(text) if joint else None,
            text_first=kind == "joint_first",
            text_mask=text_mask,
            scale=scale,
            wire=self.wire,
        )

    def linear_sums(self, name: str, key, value):
        """The whole image's linear-attention sums [B, H, D+1, D] from this rank's keys and values: its own,
        all-reduced over the sequence-parallel ranks (attention/linear.py)."""
        return reduce_sums(linear_sums(key, value), self.mesh)

    # ---- a convolution over token rows (row_halo.py): every shard whole rows, halo rows from the neighbours ----
    def token_rows(self, height: int, width: int) -> int:
        """The rows of this rank's shard of a height × width token grid, refused where it is not whole rows."""
        start, stop = self.shard_range
        if start % width or stop % width:
            sp = self.mesh.group_size(SP)
            raise ValueError(
                f"{self.state.adapter.family} convolves its tokens as an image (a 3 × 3 convolution over rows), so "
                f"each of the {sp} sequence-parallel ranks (ulysses {self.mesh.group_size(ULYSSES)} × ring "
                f"{self.mesh.group_size(RING)}) must hold whole token rows: {height} rows of {width} tokens do not "
                f"split so; use an image whose token rows are a multiple of {sp}, or a smaller ulysses × ring"
            )
        return (stop - start) // width

    def halo_sizes(self, reach: int) -> tuple[int, int]:
        """Rows a halo adds above and below this rank's band: `reach` from each neighbour, none at an edge."""
        sp, me = self.mesh.group_size(SP), self.mesh.group_rank(SP)
        return (reach if me > 0 else 0), (reach if me < sp - 1 else 0)

    def halo(self, name: str, x, reach: int):
        """x[B, C, h, W], this rank's band, with `reach` rows of each neighbouring rank's band around it (the
        control, Controls(exchanges_halo=False): zeros in their place)."""
        if not self.state.controls.exchanges_halo:
            return torch.nn.functional.pad(x, (0, 0, *self.halo_sizes(reach)))
        return exchange_halo(x, self.mesh, SP, reach)

    def _text_sizes(self, text: int) -> list[int]:
        return shard_sizes(text, self.mesh.group_size(SP))

    def _take_text_shard(self, tokens: torch.Tensor, dim: int) -> torch.Tensor:
        start, stop = shard_range(self.state.text_len, self.mesh.group_size(SP), self.mesh.group_rank(SP))
        if tokens.shape[dim] != self.state.text_len:
            raise ValueError(
                f"the joint text has {tokens.shape[dim]} tokens where {self.state.text_len} were expected "
                f"(the forward's encoder_hidden_states)"
            )
        return tokens.narrow(dim, start, stop - start)

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
