"""Sequence-parallel attention: a local kernel with a true LSE, Ulysses, Ring, and USP."""

from .local import BACKENDS, attention_backend, local_attention, merge_attention, set_attention_backend
from .usp import sp_attention

__all__ = ["BACKENDS", "attention_backend", "local_attention", "merge_attention", "set_attention_backend",
           "sp_attention"]
