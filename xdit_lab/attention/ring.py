"""Ring attention: K/V blocks travel around the ring while each rank keeps its queries.

With N ranks each holding a sequence block, step t computes this rank's queries against the
block that started t ranks back, while the next block is already in flight
(batch_isend_irecv to the next rank, from the previous). Every step leaves a partial result with
the log-sum-exp of its scores; after the last step they are merged once, all together
(`merge_stacked`: a fixed handful of operations, not a chain per block), so the result is exact:

    step 0: q_i·[k_i]   step 1: q_i·[k_(i-1)]   ...   step N-1: q_i·[k_(i+1)]   merge(all N)

Each rank sends N-1 K/V blocks. A block may hold its ranks' shards of the joint text beside their
image tokens (`text_sizes`): the text then travels with the block like any token, and costs each
rank 1/N of the work. Padded text (a key mask over the text, Qwen-Image, HunyuanVideo) splits a
step in two calls, the block's image keys unmasked with the fastest kernel and its few text keys
masked (`text_mask`, [B, T] over the whole text: block r's text is its own range of it).

Text whole on every rank (`joint=`, PipeFusion's stale attention keeps it so) is attended exactly
once, locally, not passed around; text queries are computed against the local block only, the
ranks then all-gather these small partial results with their LSE and merge them in block order, so
every rank ends with bit-identical text outputs.

With `wire` (ParallelConfig.comm_dtype) a block travels in float8 with a scale per token and head
(wire.py): a rank packs its own block once and forwards the packed blocks it receives as they came (a
block is rounded once, whatever its hops), unpacking each into the model's dtype to attend it. Its own
block it attends unrounded. The text partials stay float32: their LSE must merge exactly.
"""

from __future__ import annotations

import math

import torch

from .. import comm
from ..mesh import RING
from .local import local_attention, merge_stacked


def ring_attention(
    q,
    k,
    v,
    mesh,
    block_sizes: list[int],
    *,
    text_sizes: list[int] | None = None,
    text_first: bool = True,
    text_mask=None,
    joint=None,
    joint_mask=None,
    scale=None,
    group: str = RING,
    tag_prefix: str = "",
    wire=None,
):
    """q, k, v [B, H, S_me, D]: this ring rank's block (any strides). block_sizes: every ring rank's
    block length, in ring order. text_sizes: how many of each block's tokens are joint text, before
    its image tokens when text_first, else after them; text_mask: optional [B, sum(text_sizes)] bool
    over that text, in ring order. joint: optional (q, k, v) of text tokens whole on every rank;
    joint_mask: optional [B, T] bool over their keys. group: the mesh group that forms the ring (the sp
    group when Ulysses cannot split the heads). wire: float8 on the wire (wire.py), None: k's dtype.
    Returns (out [B, H, S_me, D] as a view of [B, S_me, H, D] memory, joint_out or None)."""
    n = len(block_sizes)
    me = mesh.group_rank(group)
    members = mesh.group_ranks(group)
    send_to, recv_from = members[(me + 1) % n], members[(me - 1) % n]
    batch, heads, _, head_dim = k.shape
    text_starts = [0, *_running(text_sizes or [0] * n)]
    masked = text_mask is not None

    parts = []  # (out, lse) of every call, merged once at the end
    if joint is not None and q.shape[2] and joint[1].shape[2]:
        parts.append(local_attention(q, joint[1], joint[2], scale=scale, key_mask=joint_mask))  # text K/V, once

    # Two flat buffers, each big enough for the largest block, take turns: one is sent and
    # computed on while the next block arrives in the other (no allocation per step).
    # With a wire the two buffers hold packed bytes (uint8, pinned) and one more holds the block attended.
    largest = 2 * batch * heads * max(block_sizes) * head_dim
    carried = k.dtype if wire is None else torch.uint8
    wide = largest if wire is None else wire.packed_size(largest, head_dim)
    buffers = [k.new_empty(wide, dtype=carried), k.new_empty(wide, dtype=carried)]
    attended = buffers[0] if wire is None else k.new_empty(largest, dtype=k.dtype)
    kv = attended[: 2 * k.numel()].view(2, *k.shape)
    torch.stack([k, v], out=kv)  # one message per step instead of two
    travelling = (
        kv if wire is None else wire.pack(kv, head_dim, out=buffers[0][: wire.packed_size(kv.numel(), head_dim)])
    )
    for step in range(n):
        source = (me - step) % n  # the ring rank whose block we hold now
        requests = []
        if step + 1 < n:  # start moving the next block before computing on this one
            shape = (2, batch, heads, block_sizes[(source - 1) % n], head_dim)
            size = math.prod(shape) if wire is None else wire.packed_size(math.prod(shape), head_dim)
            incoming = buffers[(step + 1) % 2][:size]
            incoming = incoming.view(shape) if wire is None else incoming
            requests = comm.exchange(
                [(travelling, send_to)], [(incoming, recv_from)], mesh, group, tag=tag_prefix + "kv"
            )
        if kv.shape[3] and q.shape[2]:
            text = text_sizes[source] if text_sizes else 0
            if masked and text:  # image keys unmasked, the block's text keys under their mask
                length = kv.shape[3]
                image = slice(text, length) if text_first else slice(0, length - text)
                words = slice(0, text) if text_first else slice(length - text, length)
                mask = text_mask[:, text_starts[source] : text_starts[source] + text]
                parts.append(local_attention(q, kv[0, :, :, image], kv[1, :, :, image], scale=scale))
                parts.append(local_attention(q, kv[0, :, :, words], kv[1, :, :, words], scale=scale, key_mask=mask))
            else:
                parts.append(local_attention(q, kv[0], kv[1], scale=scale))
        comm.wait(requests)
        if requests:
            travelling = incoming
            if wire is None:
                kv = incoming
            else:  # kv was attended above: its buffer takes the next block
                kv = wire.unpack(incoming, head_dim, k.dtype, out=attended[: math.prod(shape)]).view(shape)

    if parts:
        out = merge_stacked(parts, q.dtype, token_major=True)
    else:
        out = q.new_zeros((batch, q.shape[2], heads, head_dim)).transpose(1, 2)
    if joint is None:
        return out, None
    return out, _joint_queries(joint, joint_mask, k, v, mesh, scale, group, tag_prefix)


def _running(sizes):
    total, out = 0, []
    for size in sizes:
        total += size
        out.append(total)
    return out


def _joint_queries(joint, joint_mask, k, v, mesh, scale, group, tag_prefix):
    """Text queries (whole on every rank) against all image blocks and the text: each ring rank does
    its own block."""
    text_q, text_k, text_v = joint
    if k.shape[2]:
        part_out, part_lse = local_attention(text_q, k, v, scale=scale)
    else:  # an empty block contributes nothing: weight exp(-inf) = 0
        part_out = torch.zeros_like(text_q)
        part_lse = text_q.new_full(text_q.shape[:3], float("-inf"), dtype=torch.float32)
    # out and lse travel together: lse as one extra feature column (float32 keeps it exact)
    packed = torch.cat([part_out.float(), part_lse.unsqueeze(-1)], dim=-1)
    gathered = comm.all_gather(packed.unsqueeze(0), mesh, group, dim=0, tag=tag_prefix + "joint_partial")
    parts = [local_attention(text_q, text_k, text_v, scale=scale, key_mask=joint_mask)]
    parts += [(block[..., :-1], block[..., -1]) for block in gathered]  # fixed ring order: the same sums everywhere
    return merge_stacked(parts, text_q.dtype)
