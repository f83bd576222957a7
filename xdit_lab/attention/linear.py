"""Linear attention (Sana's self-attention), sequence-parallel by summing, not by moving tokens.

With ReLU kernels every query reads the same two sums over all tokens, per head, in float32:

    out_i = (Σ_j v_j k_jᵀ) q_i / ((Σ_j k_j)ᵀ q_i + 1e-15)

diffusers (SanaLinearAttnProcessor2_0) pads v with a row of ones so that one product holds both sums:
sums = [v; 1] kᵀ, [B, H, D+1, D], whatever the number of tokens. So under sequence shards each rank sums
over its own tokens and one all-reduce gives every rank the whole image's sums, exactly up to the order
of a float32 sum; no token moves, and no head count limits it:

    rank r: sums_r = [v_r; 1] k_rᵀ  --all-reduce, ulysses then ring-->  Σ_r sums_r  --> out_r = sums q_r

The reduction runs over the Ulysses group first (the neighbouring ranks' fast links), then over the Ring
group: b·h·(d+1)·d floats each, 2·(N-1)/N of them out of a rank per group (xdit_lab/traffic.py), against
Ulysses' all-to-alls of 4·(N-1)/N of the local q, k, v, o that an SDPA layer moves.

Layouts as diffusers holds them: query [B, H, D, S], key [B, H, S, D], value [B, H, D, S].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import comm
from ..mesh import RING, ULYSSES


def linear_sums(key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """[v; 1] kᵀ over the tokens given: [B, H, D+1, D] float32 (key [B, H, S, D], value [B, H, D, S],
    both float32 already, as the processor casts them)."""
    return torch.matmul(F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0), key)


def linear_output(sums: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Each query against the whole image's sums: [B, H, D, S], diffusers' normalization."""
    out = torch.matmul(sums, query)
    return out[:, :, :-1] / (out[:, :, -1:] + 1e-15)


def stale_sums_bytes(layers: int, rows: int, heads: int, head_dim: int, patches: int) -> int:
    """What a PipeFusion stage keeps of `layers` linear-attention layers between steps: each patch's latest sums,
    [rows, heads, head_dim + 1, head_dim] in float32 (models/pipefusion/stage.py)."""
    return layers * patches * rows * heads * (head_dim + 1) * head_dim * 4


def reduce_sums(sums: torch.Tensor, mesh, *, tag: str = "linear sums") -> torch.Tensor:
    """This rank's sums summed over every sequence-parallel rank (Ulysses' group, then Ring's), in place."""
    comm.all_reduce(sums, mesh, ULYSSES, tag=tag)
    return comm.all_reduce(sums, mesh, RING, tag=tag)
