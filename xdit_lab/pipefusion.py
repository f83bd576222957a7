"""PipeFusion: transformer blocks split into stages, the image into patches, stale K/V between.

Each of N stages holds L/N contiguous blocks. The image's tokens are cut into M patches (row
bands). Stage s runs patch p as soon as stage s-1 hands it over, so N stages work on N
different patches at once and only patch activations cross between stages. The price: when
patch p attends, the K/V of patches not yet processed in this step are the ones the previous
step left behind (one step stale). Every attention layer keeps a full-sequence K/V buffer; a
patch overwrites its own slice with fresh K/V and reads the rest as they are:

    stale_kv[layer]   patch 0 | patch 1 | patch 2 | patch 3
    step t, patch 2:  fresh t | fresh t | fresh t | stale t-1    (written step per slice)

The first `warmup_steps` run the whole image at once, so every slice is fresh; with
warmup_steps >= num_inference_steps the result equals serial attention.

Within a stage, tokens may also be split over sequence-parallel ranks (ulysses × ring). Every
patch is sharded over them the same way (tensor_split of the patch), so a rank always owns the
same tokens of each patch: its shard of the whole image is its shard of every patch, side by
side. Ulysses' all-to-all gathers a rank's ulysses group's shards: the buffer holds K/V after
that all-to-all (for heads/ulysses), ordered ulysses-rank-major, patch-minor; with ring > 1
each ring rank holds its part of every patch and the buffers travel the ring.
"""

from __future__ import annotations

import torch

from . import comm
from .attention.ring import ring_attention
from .attention.ulysses import heads_to_seq, seq_to_heads
from .attention.usp import _local_joint
from .sharding import shard_sizes


def stage_ranges(num_blocks: int, stages: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, stop) block ranges per stage: balanced by count, or `split` block counts."""
    counts = split if split is not None else shard_sizes(num_blocks, stages)
    if len(counts) != stages or sum(counts) != num_blocks or min(counts) < 1:
        raise ValueError(f"a stage split must give each of {stages} stages at least one of the {num_blocks} blocks, "
                         f"got {counts}")
    starts = [sum(counts[:i]) for i in range(stages)]
    return [(start, start + count) for start, count in zip(starts, counts)]


def patch_ranges(grid_rows: int, grid_cols: int, num_patches: int) -> list[tuple[int, int]]:
    """Token ranges of `num_patches` row bands of a grid_rows × grid_cols token grid."""
    if num_patches > grid_rows:
        raise ValueError(f"{num_patches} patches are more than the {grid_rows} token rows of the image; "
                         f"use num_patches <= {grid_rows}")
    rows = shard_sizes(grid_rows, num_patches)
    starts = [sum(rows[:i]) for i in range(num_patches)]
    return [(start * grid_cols, (start + count) * grid_cols) for start, count in zip(starts, rows)]


class PatchLayout:
    """Which tokens each sequence-parallel rank holds when some patches are processed."""

    def __init__(self, patches: list[tuple[int, int]], sp: int):
        self.patches, self.sp = patches, sp

    def chunk(self, patch: int, sp_rank: int) -> tuple[int, int]:
        start, stop = self.patches[patch]
        sizes = shard_sizes(stop - start, self.sp)
        first = start + sum(sizes[:sp_rank])
        return first, first + sizes[sp_rank]

    def chunk_len(self, patch: int, sp_rank: int) -> int:
        start, stop = self.chunk(patch, sp_rank)
        return stop - start

    def rank_tokens(self, active: list[int], sp_rank: int) -> torch.Tensor:
        return torch.cat([torch.arange(*self.chunk(p, sp_rank)) for p in active])

    def rank_sizes(self, active: list[int]) -> list[int]:
        return [sum(self.chunk_len(p, i) for p in active) for i in range(self.sp)]

    def gather_order(self, active: list[int]) -> torch.Tensor:
        """Token positions of an all-gather over sp ranks of their rank_tokens (in rank order)."""
        return torch.cat([self.rank_tokens(active, i) for i in range(self.sp)])


class StaleKV:
    """One attention layer's K/V for the whole sequence (this rank's part), with the step that
    last wrote each (ulysses-source, patch) slice, and a record of what attention read.

    `reads`: one entry per attention call of the latest step, (step, active patches, the step
    that wrote each patch's slice of the K/V handed to attention; None: never written). A few
    ints per call, kept on the host, so recording costs no device sync. The K/V-age view reads
    this record, not a rule about which patch should be fresh."""

    def __init__(self, layout: PatchLayout, ulysses: int, ring_rank: int):
        self.layout, self.ulysses, self.ring_rank = layout, ulysses, ring_rank
        self.keys = self.values = None
        patches = range(len(layout.patches))
        sources = [ring_rank * ulysses + j for j in range(ulysses)]  # sp ranks this buffer gathers
        self.offsets, offset = {}, 0
        for j, source in enumerate(sources):
            for p in patches:
                self.offsets[(j, p)] = (offset, layout.chunk_len(p, source))
                offset += layout.chunk_len(p, source)
        self.length = offset
        self.written_step = [None] * len(layout.patches)
        self.reads: list[tuple[int, list[int], list[int | None]]] = []

    def write(self, keys: torch.Tensor, values: torch.Tensor, active: list[int], step: int) -> None:
        """keys/values [B, H, n, D] after the Ulysses all-to-all: ulysses-source-major, patch-minor."""
        if self.keys is None or self.keys.shape[0] != keys.shape[0]:
            shape = (keys.shape[0], keys.shape[1], self.length, keys.shape[3])
            self.keys, self.values = keys.new_zeros(shape), values.new_zeros(shape)
        position = 0
        for j in range(self.ulysses):
            for p in active:
                start, length = self.offsets[(j, p)]
                self.keys[:, :, start:start + length] = keys[:, :, position:position + length]
                self.values[:, :, start:start + length] = values[:, :, position:position + length]
                position += length
        for p in active:
            self.written_step[p] = step

    def read(self, active: list[int], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V attention uses now (this rank's part of every patch), recorded with the step
        that wrote each patch's slice of them."""
        if self.reads and self.reads[-1][0] != step:  # a new step: keep only its reads
            self.reads = []
        self.reads.append((step, list(active), list(self.written_step)))
        return self.keys, self.values


def stale_attention(q, k, v, mesh, buffer: StaleKV, active: list[int], step: int, *, joint=None, scale=None):
    """Attention of the active patches' queries over the whole sequence: fresh K/V for the active
    patches, the buffer's (possibly stale) K/V for the rest. q, k, v: this rank's tokens of the
    active patches [B, H, n, D]. Returns (out, joint_out)."""
    layout, ulysses = buffer.layout, mesh.group_size("ulysses")
    ring = mesh.group_size("ring")
    sources = [buffer.ring_rank * ulysses + j for j in range(ulysses)]
    seq_sizes = [sum(layout.chunk_len(p, s) for p in active) for s in sources]
    if ulysses > 1:
        q, k, v = (seq_to_heads(t, mesh, seq_sizes, tag=name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
        if joint is not None:
            me, per_rank = mesh.group_rank("ulysses"), q.shape[1]
            joint = tuple(t.narrow(1, me * per_rank, per_rank) for t in joint)
    buffer.write(k, v, active, step)
    keys, values = buffer.read(active, step)
    if ring == 1:
        out, joint_out = _local_joint(q, keys, values, joint=joint, scale=scale)
    else:  # each ring rank's buffer holds its part of every patch, written on the same schedule
        block_sizes = [sum(layout.chunk_len(p, r * ulysses + j) for j in range(ulysses)
                           for p in range(len(layout.patches))) for r in range(ring)]
        out, joint_out = ring_attention(q, keys, values, mesh, block_sizes, joint=joint, scale=scale)
    if ulysses > 1:
        out = heads_to_seq(out, mesh, seq_sizes, tag="out")
        if joint_out is not None:
            joint_out = comm.all_gather(joint_out, mesh, "ulysses", dim=1, tag="joint_out")
    return out, joint_out
