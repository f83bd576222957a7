"""How a sequence is cut into shards: contiguous chunks in group-rank order, sized as
torch.tensor_split sizes them (the first `total % parts` shards get one extra token)."""

from __future__ import annotations

import torch


def shard_sizes(total: int, parts: int) -> list[int]:
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def shard_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[start, stop) of shard `index`."""
    sizes = shard_sizes(total, parts)
    start = sum(sizes[:index])
    return start, start + sizes[index]


def take_shard(x: torch.Tensor, dim: int, parts: int, index: int) -> torch.Tensor:
    """Shard `index` of `parts` along `dim` (a view, no copy)."""
    start, stop = shard_range(x.shape[dim], parts, index)
    return x.narrow(dim, start, stop - start)
