"""Sequence-parallel attention: a local kernel with a true LSE, Ulysses, Ring, USP, and PipeFusion's
attention over stale K/V buffers (stale.py)."""

from .local import (
    BACKENDS,
    attention,
    attention_backend,
    joint_local_attention,
    local_attention,
    merge_attention,
    merge_stacked,
    set_attention_backend,
)
from .usp import sp_attention, sp_attention_sharded, whole_query_attention

__all__ = [
    "BACKENDS",
    "attention",
    "attention_backend",
    "joint_local_attention",
    "local_attention",
    "merge_attention",
    "merge_stacked",
    "set_attention_backend",
    "sp_attention",
    "sp_attention_sharded",
    "whole_query_attention",
]
