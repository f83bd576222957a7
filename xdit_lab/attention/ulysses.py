"""Ulysses attention: trade sequence shards for head shards with two all-to-alls.

Each of the N ranks of a Ulysses group holds a chunk of the sequence with all H heads. An
all-to-all gives every rank the whole (group's) sequence for H/N heads, attention runs there
unsplit, and a second all-to-all gives each rank its sequence chunk back with all heads:

    q[B, H, S/N, D] --all-to-all--> q[B, H/N, S, D] --attention--> o[B, H/N, S, D]
                    --all-to-all--> o[B, H, S/N, D]

q, k, v and o each cross the network once; (N-1)/N of each leaves the rank. Shards may have
unequal lengths (S not divisible by N): the all-to-all moves them as they are, nothing padded.
Joint text tokens are whole on every rank, so their heads are simply sliced locally; only their
output is gathered over heads at the end.
"""

from __future__ import annotations

import torch

from .. import comm
from ..mesh import ULYSSES


def seq_to_heads(x: torch.Tensor, mesh, seq_sizes: list[int], *, tag: str = "") -> torch.Tensor:
    """x[B, H, S_me, D] -> x[B, H/N, S, D]: scatter heads, gather the sequence."""
    batch, heads, _, head_dim = x.shape
    n = len(seq_sizes)
    per_rank = heads // n
    chunks = list(x.split(per_rank, dim=1))  # chunk j: the heads that group rank j will own
    recv_shapes = [(batch, per_rank, size, head_dim) for size in seq_sizes]
    return torch.cat(comm.all_to_all(chunks, recv_shapes, mesh, ULYSSES, tag=tag), dim=2)


def heads_to_seq(x: torch.Tensor, mesh, seq_sizes: list[int], *, tag: str = "") -> torch.Tensor:
    """x[B, H/N, S, D] -> x[B, H, S_me, D]: scatter the sequence, gather heads."""
    batch, per_rank, _, head_dim = x.shape
    me = mesh.group_rank(ULYSSES)
    chunks = list(x.split(seq_sizes, dim=2))  # chunk j: the tokens that group rank j owns
    recv_shapes = [(batch, per_rank, seq_sizes[me], head_dim)] * len(seq_sizes)
    return torch.cat(comm.all_to_all(chunks, recv_shapes, mesh, ULYSSES, tag=tag), dim=1)


def ulysses_attention(q, k, v, mesh, seq_sizes: list[int], inner, *, joint=None, scale=None):
    """Attention over the Ulysses group's whole sequence, computed on H/N heads per rank.

    seq_sizes: every group rank's local sequence length, in group order. `inner(q, k, v,
    joint=..., scale=...)` computes attention on the gathered tensors and returns
    (out, joint_out); it is local attention, or Ring attention when Ulysses runs inside Ring."""
    n = len(seq_sizes)
    me = mesh.group_rank(ULYSSES)
    per_rank = q.shape[1] // n
    q, k, v = (seq_to_heads(t, mesh, seq_sizes, tag=name) for t, name in ((q, "q"), (k, "k"), (v, "v")))
    if joint is not None:  # replicated text: every rank already has every head
        joint = tuple(t.narrow(1, me * per_rank, per_rank) for t in joint)
    out, joint_out = inner(q, k, v, joint=joint, scale=scale)
    out = heads_to_seq(out, mesh, seq_sizes, tag="out")
    if joint_out is not None:
        joint_out = comm.all_gather(joint_out, mesh, ULYSSES, dim=1, tag="joint_out")
    return out, joint_out
