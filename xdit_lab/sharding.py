"""Index math: how tokens and blocks are cut between ranks. No communication, no model.

A sequence shard is a contiguous chunk in group-rank order, sized as torch.tensor_split sizes
them (the first `total % parts` shards get one extra token). PipeFusion adds two cuts on top:
blocks into stages (contiguous runs of blocks), and the image into patches (row bands), each
patch then sharded over the sequence-parallel ranks the same way. For a 4 × 4 token grid, 2
patches and 2 sp ranks:

    token rows 0-1: patch 0   sp rank 0 holds tokens 0-3,  sp rank 1 tokens 4-7
    token rows 2-3: patch 1   sp rank 0 holds tokens 8-11, sp rank 1 tokens 12-15

so a rank owns the same part of every patch, side by side. Where other images' tokens follow the
drawn one's (an edit's reference images), patch i is row band i of every image (patch_layout): the
patches are contiguous in patch order, and the layout maps that order back to the sequence's.
The batch is cut too: batch_rows.
"""

from __future__ import annotations

import torch


def shard_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def batch_rows(total: int, cfg: int, dp: int, cfg_rank: int, dp_rank: int) -> tuple[int, int, list[int]]:
    """Rows [start, stop) of a batch of `total` rows, [unconditional; conditional], that the rank at
    (cfg_rank, dp_rank) computes, and the dp sizes: cfg 2 takes its half, dp then splits what is
    left as torch.tensor_split does. A dp rank left without rows computes the branch's last row as
    a stand-in (its output is dropped), so that every collective still lines up."""
    start, count = 0, total
    if cfg == 2:
        if total % 2:
            raise ValueError(
                f"cfg 2 splits the batch [unconditional; conditional] in halves, but the batch has "
                f"{total} samples; pass both branches, or use cfg 1"
            )
        count = total // 2
        start = cfg_rank * count
    sizes = shard_sizes(count, dp)
    start += sum(sizes[:dp_rank])
    mine = sizes[dp_rank] or 1
    if not sizes[dp_rank]:
        start -= 1
    return start, start + mine, sizes


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard `index`."""
    sizes = shard_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def take_shard(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Shard `index` of `parts` along `dim` (a view, no copy)."""
    start, stop = shard_range(x.shape[dim], parts, index)
    return x.narrow(dim, start, stop - start)


# ---- PipeFusion: blocks into stages, the image into patches ---------------------------------------------


def stage_ranges(num_blocks: int, stages: int, split: list[int] | None = None) -> list[tuple[int, int]]:
    """Contiguous [start, stop) block ranges per stage: balanced by count, or `split` block counts."""
    counts = split if split is not None else shard_sizes(num_blocks, stages)
    if len(counts) != stages or sum(counts) != num_blocks or min(counts) < 1:
        raise ValueError(
            f"a stage split must give each of {stages} stages at least one of the {num_blocks} blocks, got {counts}"
        )
    starts = [sum(counts[:i]) for i in range(stages)]
    return [(start, start + count) for start, count in zip(starts, counts)]


def patch_ranges(grid_rows: int, grid_cols: int, num_patches: int, padded: int = 0) -> list[tuple[int, int]]:
    """Token ranges of `num_patches` row bands of a grid_rows × grid_cols token grid; `padded` tokens the model
    adds after the grid (Z-Image's, to a multiple of 32) go with the last band."""
    if num_patches > grid_rows:
        raise ValueError(
            f"{num_patches} patches are more than the {grid_rows} token rows of the image; "
            f"use num_patches <= {grid_rows}"
        )
    rows = shard_sizes(grid_rows, num_patches)
    starts = [sum(rows[:i]) for i in range(num_patches)]
    ranges = [(start * grid_cols, (start + count) * grid_cols) for start, count in zip(starts, rows)]
    ranges[-1] = (ranges[-1][0], ranges[-1][1] + padded)
    return ranges


class PatchLayout:
    """Which tokens each sequence-parallel rank holds when some patches are processed. `patches`:
    [start, stop) of each patch in patch order; `order`: the sequence's position of each token in
    that order (None: the sequence's own order, every patch one band of one grid)."""

    def __init__(self, patches: list[tuple[int, int]], sp: int, order: torch.Tensor | None = None):
        self.patches, self.sp, self.order = patches, sp, order

    def chunk(self, patch: int, sp_rank: int) -> tuple[int, int]:
        start, stop = self.patches[patch]
        return tuple(start + i for i in shard_range(stop - start, self.sp, sp_rank))

    def chunk_len(self, patch: int, sp_rank: int) -> int:
        start, stop = self.chunk(patch, sp_rank)
        return stop - start

    def rank_tokens(self, active: list[int], sp_rank: int) -> torch.Tensor:
        """The sequence positions of this rank's tokens of the active patches, patch by patch."""
        tokens = torch.cat([torch.arange(*self.chunk(p, sp_rank)) for p in active])
        return tokens if self.order is None else self.order[tokens]

    def rank_ranges(self, patch: int, sp_rank: int) -> list[tuple[int, int]]:
        """This rank's tokens of `patch` as [start, stop) ranges of the sequence (one per image it spans)."""
        if self.order is None:
            return [self.chunk(patch, sp_rank)]
        runs = []
        for token in self.rank_tokens([patch], sp_rank).tolist():
            if runs and runs[-1][1] == token:
                runs[-1][1] = token + 1
            else:
                runs.append([token, token + 1])
        return [tuple(run) for run in runs]

    def rank_sizes(self, active: list[int]) -> list[int]:
        return [sum(self.chunk_len(p, i) for p in active) for i in range(self.sp)]

    def gather_order(self, active: list[int]) -> torch.Tensor:
        """Token positions of an all-gather over sp ranks of their rank_tokens (in rank order)."""
        return torch.cat([self.rank_tokens(active, i) for i in range(self.sp)])


def patch_layout(
    grid: tuple[int, int], num_patches: int, sp: int, appended: tuple[tuple[int, int], ...] = (), padded: int = 0
) -> PatchLayout:
    """The patches of a rows × cols token `grid`, each sharded over `sp` ranks. `appended`: (rows, cols) of
    the images whose tokens follow the grid's in the sequence, one after another (an edit's reference
    images): patch i is then row band i of every image, so each patch holds its share of every image and
    no token runs twice. `padded`: tokens the model adds after the grid (Z-Image's), with the last patch."""
    if padded and appended:
        raise NotImplementedError(
            "padding tokens between the drawn image and the images after it are not cut into patches"
        )
    if not appended:
        return PatchLayout(patch_ranges(*grid, num_patches, padded=padded), sp)
    bands, offset = [], 0  # per image, its bands' [start, stop) in the sequence
    for rows, cols in (grid, *appended):
        bands.append([(offset + start, offset + stop) for start, stop in patch_ranges(rows, cols, num_patches)])
        offset += rows * cols
    in_patch_order = [band for p in range(num_patches) for band in (image[p] for image in bands)]
    order = torch.cat([torch.arange(start, stop) for start, stop in in_patch_order])
    sizes = [sum(image[p][1] - image[p][0] for image in bands) for p in range(num_patches)]
    starts = [sum(sizes[:p]) for p in range(num_patches)]
    return PatchLayout([(start, start + size) for start, size in zip(starts, sizes)], sp, order)


def gather_buffer_bytes(largest_block: int, root: int) -> int:
    """The unsharded copies a sharded forward holds at once, on top of the shards, from the whole parameter
    bytes of its largest block unit and of its root: max(3 × largest, 2 × largest + root) + root (the
    running block, its all-gather output, the next block's, and the root whole through the forward;
    model_folder.py's Weights.gather derives it from FSDP2's unshard order and measures it)."""
    return max(3 * largest_block, 2 * largest_block + root) + root
