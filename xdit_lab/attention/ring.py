"""Ring attention: K/V blocks travel around the ring while each rank keeps its queries.

With N ranks each holding a sequence block, step t computes this rank's queries against the
block that started t ranks back, while the next block is already in flight
(batch_isend_irecv to the next rank, from the previous). Partial results are folded together
with their log-sum-exp (online softmax), so the result is exact:

    step 0: q_i·[k_i]   step 1: q_i·[k_(i-1)]   ...   step N-1: q_i·[k_(i+1)]

Each rank sends N-1 K/V blocks. Joint text K/V (whole on every rank) is attended exactly once,
locally, not passed around. Text queries (also whole on every rank) are computed against the
local block only; the ranks then all-gather these small partial results with their LSE and
merge them in block order, so text costs each rank 1/N of the work and every rank ends with
bit-identical text outputs. Padded text (a key mask over the text, Qwen-Image) only changes the two
local calls on the text K/V; the blocks that travel are image tokens, never masked.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..mesh import RING
from .local import local_attention, merge_attention


def ring_attention(
    q,
    k,
    v,
    mesh,
    block_sizes: list[int],
    *,
    joint=None,
    joint_mask=None,
    scale=None,
    group: str = RING,
    tag_prefix: str = "",
):
    """q, k, v [B, H, S_me, D]: this ring rank's block. block_sizes: every ring rank's block
    length, in ring order. joint: optional (q, k, v) of replicated text tokens; joint_mask:
    optional [B, T] bool over their keys. group: the mesh group that forms the ring (the sp group
    when Ulysses cannot split the heads).
    Returns (out [B, H, S_me, D], joint_out or None)."""
    n = len(block_sizes)
    me = mesh.group_rank(group)
    members = mesh.group_ranks(group)
    send_to, recv_from = members[(me + 1) % n], members[(me - 1) % n]
    batch, heads, _, head_dim = k.shape

    out = lse = None
    if joint is not None and q.shape[2]:
        out, lse = local_attention(q, joint[1], joint[2], scale=scale, key_mask=joint_mask)  # text K/V, once

    # Two flat buffers, each big enough for the largest block, take turns: one is sent and
    # computed on while the next block arrives in the other (no allocation per step).
    largest = 2 * batch * heads * max(block_sizes) * head_dim
    buffers = [k.new_empty(largest, dtype=k.dtype), k.new_empty(largest, dtype=k.dtype)]
    kv = buffers[0][: 2 * k.numel()].view(2, *k.shape)
    torch.stack([k, v], out=kv)  # one message per step instead of two
    for step in range(n):
        source = (me - step) % n  # the ring rank whose block we hold now
        requests = []
        if step + 1 < n:  # start moving the next block before computing on this one
            shape = (2, batch, heads, block_sizes[(source - 1) % n], head_dim)
            incoming = buffers[(step + 1) % 2][: math.prod(shape)].view(shape)
            requests = comm.exchange([(kv, send_to)], [(incoming, recv_from)], mesh, group, tag=tag_prefix + "kv")
        if kv.shape[3] and q.shape[2]:
            out, lse = merge_attention(out, lse, *local_attention(q, kv[0], kv[1], scale=scale))
        comm.wait(requests)
        if requests:
            kv = incoming

    out = out.to(q.dtype) if out is not None else torch.zeros_like(q)
    if joint is None:
        return out, None
    return out, _joint_queries(joint, joint_mask, k, v, mesh, scale, group, tag_prefix)


def _joint_queries(joint, joint_mask, k, v, mesh, scale, group, tag_prefix):
    """Text queries against all image blocks and the text: each ring rank does its own block."""
    text_q, text_k, text_v = joint
    if k.shape[2]:
        part_out, part_lse = local_attention(text_q, k, v, scale=scale)
    else:  # an empty block contributes nothing: weight exp(-inf) = 0
        part_out = torch.zeros_like(text_q)
        part_lse = text_q.new_full(text_q.shape[:3], float("-inf"), dtype=torch.float32)
    # out and lse travel together: lse as one extra feature column (float32 keeps it exact)
    packed = torch.cat([part_out.float(), part_lse.unsqueeze(-1)], dim=-1)
    gathered = comm.all_gather(packed.unsqueeze(0), mesh, group, dim=0, tag=tag_prefix + "joint_partial")
    out, lse = local_attention(text_q, text_k, text_v, scale=scale, key_mask=joint_mask)
    for block in gathered:  # fixed ring order: the same floating-point sums on every rank
        out, lse = merge_attention(out, lse, block[..., :-1], block[..., -1])  # an empty block's is a no-op
    return out.to(text_q.dtype)
