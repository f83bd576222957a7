"""sp_attention: the public entry of sequence-parallel attention (Ulysses, Ring, or both: USP).

The sequence-parallel ("sp") group of a RankMesh is ring × ulysses, ulysses varying fastest.
Every sp rank holds one contiguous shard of the image tokens, in sp-rank order, sized as
torch.tensor_split sizes them. USP runs Ulysses inside Ring: the Ulysses all-to-all gathers a
ring rank's contiguous block (its Ulysses group's shards, side by side) for H/ulysses heads,
Ring attention runs over those blocks, and the second all-to-all hands the shards back. Any head
count: a Ulysses rank attends its tensor_split share of the heads (ulysses.py), one head at least.

Three kinds of attention, as diffusers' DiT families use them:
  self   q, k, v all sharded (image tokens)
  joint  plus text tokens (SD3, Flux, CogVideoX, ...), in one of two ways:
         sharded  `sp_attention_sharded`: each rank holds its shard of the text beside its image
                  shard, in the model's own order ([text; image] or [image; text]); the text travels
                  with the image in the same all-to-all or Ring block, and each rank computes only
                  its share of it (what `parallelize` does)
         whole    `sp_attention(joint_q=...)`: text tokens whole on every rank; text keys are
                  attended exactly once, and the text output comes back whole on every rank (what a
                  PipeFusion stage does)
         joint_mask / text_mask [B, T] bool masks padded text keys (Qwen-Image, HunyuanVideo)
  cross  kv_sharded=False: queries sharded, text K/V whole and local (PixArt); no communication
  whole queries  `whole_query_attention`: queries whole on every rank against the image's sharded K/V (LTX-2's
         audio asking the video): each rank attends to its keys, and the partials are merged by their LSE
"""

from __future__ import annotations

import torch

from .. import comm
from ..mesh import RING, SP, ULYSSES
from ..sharding import shard_sizes
from .local import attention, joint_local_attention, local_attention, merge_stacked
from .ring import ring_attention
from .ulysses import gathered_pieces, heads_to_seq, seq_to_heads, ulysses_attention


def sp_attention_sharded(
    q,
    k,
    v,
    mesh,
    image_sizes: list[int],
    text_sizes: list[int] | None = None,
    *,
    text_first: bool = True,
    text_mask: torch.Tensor | None = None,
    scale: float | None = None,
    wire=None,
) -> torch.Tensor:
    """Exact attention over the whole sequence (every rank's image and text tokens), computed from
    this rank's shard of both.

    q, k, v: [B, H, L_me, D], any strides: this rank's tokens in its own order, its text shard before
    its image shard when text_first, else after it. image_sizes, text_sizes: every sp rank's shard
    lengths (text_sizes None: no text, self-attention). text_mask: optional [B, T] bool over the whole
    text (True: attend), every rank holding all of it. Returns out [B, H, L_me, D] in q's token order,
    a view of [B, L_me, H, D] memory (what the model's output projection reads). wire: float8 on the
    wire for the all-to-alls and the Ring blocks (wire.py; ParallelConfig.comm_dtype), None: q's dtype.

        rank r: [t_r; i_r] --ulysses all-to-all--> the group's tokens, H_r heads --ring over the groups'
        blocks (or one local call)--> --all-to-all back--> [t_r; i_r], every head"""
    sp, ulysses, ring = mesh.group_size(SP), mesh.group_size(ULYSSES), mesh.group_size(RING)
    text_sizes = list(text_sizes) if text_sizes is not None else [0] * sp
    sizes = [i + t for i, t in zip(image_sizes, text_sizes)]
    _check_sharded(q, k, v, mesh, image_sizes, text_sizes, text_mask)
    masked = text_mask is not None and sum(text_sizes) > 0
    ring_rank = mesh.group_rank(RING)
    mine = slice(ring_rank * ulysses, (ring_rank + 1) * ulysses)
    pieces, heads = None, q.shape[1]
    if ulysses > 1:  # a mask wants the gathered image keys apart from the text keys: image first
        pieces = gathered_pieces(sizes[mine], text_sizes[mine] if masked else None, text_first=text_first)
        q, k, v = seq_to_heads((q, k, v), mesh, sizes[mine], pieces=pieces, tag="qkv", wire=wire)
        text_first = text_first and not masked  # image first now, where it matters
    if ring > 1:
        blocks = [slice(r * ulysses, (r + 1) * ulysses) for r in range(ring)]
        out, _ = ring_attention(
            q,
            k,
            v,
            mesh,
            [sum(sizes[b]) for b in blocks],
            text_sizes=[sum(text_sizes[b]) for b in blocks] if masked else None,
            text_first=text_first,
            text_mask=text_mask if masked else None,
            scale=scale,
            wire=wire,
        )
    elif masked:  # ulysses alone, the group's whole sequence here: [image | text] keys, the text's masked
        image = sum(image_sizes)
        key_mask = torch.cat([text_mask.new_ones((text_mask.shape[0], image)), text_mask], dim=1)
        out = attention(q, k, v, scale=scale, key_mask=key_mask)
    else:
        out = attention(q, k, v, scale=scale)
    if ulysses > 1:
        out, _ = heads_to_seq(out, mesh, sizes[mine], heads=heads, pieces=pieces, tag="out", wire=wire)
    return out


def _check_sharded(q, k, v, mesh, image_sizes, text_sizes, text_mask):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape != q.shape:
            raise ValueError(
                f"q, k and v must be one shape, [batch, heads, seq, head_dim] (SDPA layout); got {name} {tuple(t.shape)}, "
                f"q {tuple(q.shape)}"
            )
    sp, me = mesh.group_size(SP), mesh.group_rank(SP)
    if len(image_sizes) != sp or len(text_sizes) != sp:
        raise ValueError(f"image_sizes {image_sizes} and text_sizes {text_sizes} need one entry per sp rank ({sp})")
    if q.shape[2] != image_sizes[me] + text_sizes[me]:
        raise ValueError(
            f"sp rank {me} holds {q.shape[2]} tokens, but its shards are {image_sizes[me]} image and "
            f"{text_sizes[me]} text tokens"
        )
    if min(image_sizes) == 0:
        raise ValueError(f"every sp rank needs an image token; the image shards are {image_sizes}")
    if text_mask is not None and (text_mask.dtype != torch.bool or text_mask.shape != (q.shape[0], sum(text_sizes))):
        raise ValueError(
            f"text_mask masks the whole text's keys: bool [batch, text] = [{q.shape[0]}, {sum(text_sizes)}], got "
            f"{text_mask.dtype} {tuple(text_mask.shape)}"
        )
    _check_heads(q.shape[1], mesh.group_size(ULYSSES))


def _check_heads(heads: int, ulysses: int) -> None:
    """Any head count splits over Ulysses (ulysses.py: head_counts), as long as every rank gets a head."""
    if heads < ulysses:
        raise ValueError(
            f"{heads} attention heads cannot give each of ulysses {ulysses} ranks a head; use ulysses <= {heads} "
            f"(ring for the rest of the sequence parallelism)"
        )


def sp_attention(
    q,
    k,
    v,
    mesh,
    *,
    joint_q=None,
    joint_k=None,
    joint_v=None,
    joint_mask=None,
    seq_len: int | None = None,
    scale: float | None = None,
    kv_sharded: bool = True,
    wire=None,
):
    """Exact attention over the whole sequence, computed from this rank's shard.

    q, k, v: [batch, heads, local_seq, head_dim], this rank's shard. seq_len: the whole image
    sequence length (pass it: without it the shard lengths are gathered, a small extra
    collective). wire: float8 on the wire (wire.py), None: q's dtype; the text partials Ring gathers
    stay float32. Returns this rank's output shard, and with joint_q the text output as well:
    `(out, joint_out)`."""
    joint = _check_inputs(q, k, v, mesh, joint_q, joint_k, joint_v, kv_sharded)
    if joint_mask is not None and (joint is None or joint_mask.shape != (q.shape[0], joint_k.shape[2])):
        raise ValueError(
            f"joint_mask masks text keys: it needs joint tokens and shape [batch, text] = "
            f"[{q.shape[0]}, {None if joint is None else joint_k.shape[2]}], got {tuple(joint_mask.shape)}"
        )
    if not kv_sharded:  # cross-attention: every query row sees the whole text locally
        return attention(q, k, v, scale=scale)

    ulysses, ring = mesh.group_size(ULYSSES), mesh.group_size(RING)
    sizes = _sp_shard_sizes(q, mesh, seq_len)
    ring_rank = mesh.group_rank(RING)
    ulysses_sizes = sizes[ring_rank * ulysses : (ring_rank + 1) * ulysses]
    block_sizes = [sum(sizes[i * ulysses : (i + 1) * ulysses]) for i in range(ring)]

    inner = (
        joint_local_attention
        if ring == 1
        else (
            lambda q_, k_, v_, *, joint, joint_mask, scale: ring_attention(
                q_, k_, v_, mesh, block_sizes, joint=joint, joint_mask=joint_mask, scale=scale, wire=wire
            )
        )
    )
    if ulysses > 1:
        out, joint_out = ulysses_attention(
            q, k, v, mesh, ulysses_sizes, inner, joint=joint, joint_mask=joint_mask, scale=scale, wire=wire
        )
    else:
        out, joint_out = inner(q, k, v, joint=joint, joint_mask=joint_mask, scale=scale)
    return out if joint is None else (out, joint_out)


def _sp_shard_sizes(q, mesh, seq_len):
    sp = mesh.group_size(SP)
    if seq_len is None:
        local = torch.tensor([q.shape[2]], dtype=torch.int64, device=q.device)  # NCCL moves device tensors only
        sizes = [int(s) for s in comm.all_gather(local, mesh, SP, dim=0, tag="shard_sizes")] if sp > 1 else [q.shape[2]]
        if sizes != shard_sizes(sum(sizes), sp):
            raise ValueError(
                f"sequence shards {sizes} are not a tensor_split of {sum(sizes)} tokens over "
                f"{sp} sequence-parallel ranks; shard with xdit_lab.sharding.take_shard"
            )
        return sizes
    sizes = shard_sizes(seq_len, sp)
    if q.shape[2] != sizes[mesh.group_rank(SP)]:
        raise ValueError(
            f"this rank holds {q.shape[2]} tokens, but shard {mesh.group_rank('sp')} of {seq_len} tokens "
            f"over {sp} sequence-parallel ranks has {sizes[mesh.group_rank('sp')]}"
        )
    if min(sizes) == 0:
        raise ValueError(f"{seq_len} tokens cannot give each of {sp} sequence-parallel ranks a token")
    return sizes


def _check_inputs(q, k, v, mesh, joint_q, joint_k, joint_v, kv_sharded):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, heads, seq, head_dim] (SDPA layout), got shape {tuple(t.shape)}")
    if k.shape != v.shape or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} must share batch, heads and "
            f"head_dim, and k, v one shape"
        )
    if kv_sharded and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"self-attention shards of q ({q.shape[2]} tokens) and k/v ({k.shape[2]}) differ; "
            f"for cross-attention to whole text K/V pass kv_sharded=False"
        )
    given = [t is not None for t in (joint_q, joint_k, joint_v)]
    if any(given) and not all(given):
        raise ValueError("joint attention needs joint_q, joint_k and joint_v together")
    if not all(given):
        joint = None
    else:
        if not kv_sharded:
            raise ValueError("joint tokens and kv_sharded=False (cross-attention) do not combine")
        joint = (joint_q, joint_k, joint_v)
        if (
            joint_k.shape != joint_v.shape
            or joint_q.shape[2] != joint_k.shape[2]
            or any(t.shape[0] != q.shape[0] or t.shape[1] != q.shape[1] or t.shape[3] != q.shape[3] for t in joint)
        ):
            raise ValueError(
                f"joint q/k/v {[tuple(t.shape) for t in joint]} must match q's batch, heads and "
                f"head_dim {tuple(q.shape)} and share one text length"
            )
    if kv_sharded:
        _check_heads(q.shape[1], mesh.group_size(ULYSSES))
    return joint


def whole_query_attention(q, k, v, mesh, *, scale: float | None = None):
    """Attention of queries held whole on every sp rank (q [B, H, Sq, D], the same everywhere) over keys and
    values each rank holds a shard of (k, v [B, H, S_me, D]): each rank attends to its own keys, and every rank's
    partial output and log-sum-exp, packed as one float32 [B, H, Sq, D + 1], is all-gathered over the sp group and
    merged in sp-rank order (the same sums on every rank: every rank returns the same output). Cheaper than
    gathering the keys where the queries are the shorter sequence (LTX-2's audio against its video)."""
    if k.shape[2]:
        out, lse = local_attention(q, k, v, scale=scale)
    else:  # a rank without keys contributes nothing: weight exp(-inf) = 0
        out, lse = torch.zeros_like(q), q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
    packed = torch.cat([out.float(), lse.unsqueeze(-1)], dim=-1)
    gathered = comm.all_gather(packed.unsqueeze(0), mesh, SP, dim=0, tag="whole_query_partial")
    return merge_stacked([(part[..., :-1], part[..., -1]) for part in gathered], q.dtype)
