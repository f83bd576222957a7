"""Sequence-parallel attention: a local kernel with a true LSE, Ulysses, Ring, USP, and PipeFusion's
attention over stale K/V buffers (stale.py)."""

from .local import (
    BACKENDS,
    attention_backend,
    joint_local_attention,
    local_attention,
    merge_attention,
    set_attention_backend,
)
from .usp import sp_attention

__all__ = [
    "BACKENDS",
    "attention_backend",
    "joint_local_attention",
    "local_attention",
    "merge_attention",
    "set_attention_backend",
    "sp_attention",
]
