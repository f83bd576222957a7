"""PipeFusion's attention: a patch's queries over K/V that are partly fresh and partly stale.

When patch p of an image attends, the K/V of patches not yet processed in this step are the ones
the previous step left behind (one step stale). Every attention layer of a stage keeps a
full-sequence K/V buffer; a patch overwrites its own slice with fresh K/V and reads the rest as
they are:

    stale_kv[layer]   patch 0 | patch 1 | patch 2 | patch 3
    step t, patch 2:  fresh t | fresh t | fresh t | stale t-1    (written step per slice)

With sequence parallelism inside a stage, the buffer holds K/V after the Ulysses all-to-all (for
the rank's share of the heads), ordered ulysses-rank-major, patch-minor; with ring > 1 each ring rank holds its
part of every patch and the buffers travel the ring. The schedule that decides which patches run
when is in models/pipefusion/; the index math in sharding.py. stale_kv_bytes: what the buffers
hold, for the memory plan.
"""

from __future__ import annotations

import torch

from ..mesh import RING, ULYSSES
from ..sharding import PatchLayout, patch_layout
from .local import joint_local_attention
from .ring import ring_attention
from .ulysses import head_counts, head_slice, heads_to_seq, seq_to_heads


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
                self.keys[:, :, start : start + length] = keys[:, :, position : position + length]
                self.values[:, :, start : start + length] = values[:, :, position : position + length]
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


def stale_attention(
    q, k, v, mesh, buffer: StaleKV, active: list[int], step: int, *, joint=None, joint_mask=None, scale=None
):
    """Attention of the active patches' queries over the whole sequence: fresh K/V for the active
    patches, the buffer's (possibly stale) K/V for the rest. q, k, v: this rank's tokens of the
    active patches [B, H, n, D]; joint_mask: optional [B, T] bool over the text keys. Returns
    (out, joint_out)."""
    layout, ulysses = buffer.layout, mesh.group_size(ULYSSES)
    ring = mesh.group_size(RING)
    sources = [buffer.ring_rank * ulysses + j for j in range(ulysses)]
    seq_sizes = [sum(layout.chunk_len(p, s) for p in active) for s in sources]
    heads = q.shape[1]
    if ulysses > 1:
        q, k, v = seq_to_heads((q, k, v), mesh, seq_sizes, tag="qkv")
        if joint is not None:  # whole on every rank: this rank's heads of it
            joint = tuple(t[:, head_slice(heads, ulysses, mesh.group_rank(ULYSSES))] for t in joint)
    buffer.write(k, v, active, step)
    keys, values = buffer.read(active, step)
    if ring == 1:
        out, joint_out = joint_local_attention(q, keys, values, joint=joint, joint_mask=joint_mask, scale=scale)
    else:  # each ring rank's buffer holds its part of every patch, written on the same schedule
        block_sizes = [
            sum(layout.chunk_len(p, r * ulysses + j) for j in range(ulysses) for p in range(len(layout.patches)))
            for r in range(ring)
        ]
        out, joint_out = ring_attention(
            q, keys, values, mesh, block_sizes, joint=joint, joint_mask=joint_mask, scale=scale
        )
    if ulysses > 1:
        out, joint_out = heads_to_seq(out, mesh, seq_sizes, heads=heads, joint=joint_out, tag="out")
    return out, joint_out


def stale_kv_bytes(
    *,
    layers,
    rows,
    heads,
    head_dim,
    grid,
    patches,
    ulysses,
    ring,
    ring_rank,
    element_bytes,
    ulysses_rank=None,
    appended=(),
    padded=0,
) -> int:
    """Bytes of a stage's stale K/V buffers: for each of its `layers` self-attention layers, K and V
    of the whole sequence for every batch row, this rank's part of it (its ring rank's tokens of
    every patch, for its Ulysses rank's heads: ulysses_rank None, the most heads a rank attends).
    `appended`: the grids of images whose tokens follow the `grid`'s (sharding.patch_layout); `padded`: the
    tokens the model adds after the grid (Z-Image's)."""
    layout = patch_layout(grid, patches, ulysses * ring, appended, padded=padded)
    length = sum(
        layout.chunk_len(p, ring_rank * ulysses + j) for j in range(ulysses) for p in range(len(layout.patches))
    )
    counts = head_counts(heads, ulysses)
    held_heads = max(counts) if ulysses_rank is None else counts[ulysses_rank]
    return layers * 2 * rows * held_heads * length * head_dim * element_bytes
