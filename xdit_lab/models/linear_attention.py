"""Linear attention taken over (attention kind "linear": Sana's self-attention), as our processor.

diffusers' SanaLinearAttnProcessor2_0 calls no scaled_dot_product_attention: it sums [v; 1] kᵀ over the
tokens it is given (attention/linear.py). On a rank that holds a shard those are its own tokens, so the
processor is replaced by `LinearAttention`: the same code, line for line, with one step in the middle
handed to the token strategy, which turns this rank's keys and values into the whole image's sums
(`strategy.linear_sums`: an all-reduce over the sequence-parallel ranks; a PipeFusion stage that holds the
whole image in its warm-up sums them itself).

    to_q, to_k, to_v, norms, ReLU, float32   (diffusers', unchanged)
    sums = strategy.linear_sums(name, key, value)   [B, H, D+1, D], the whole image's
    out  = linear_output(sums, query)         (diffusers', unchanged), to_out

Under torch.compile the strategy's step is one opaque operator (xdit_lab::linear_sums), as the SDPA
kinds' attention is (hooks.py), so the collectives inside run and are recorded as in eager.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from .. import comm
from ..attention.linear import linear_output, linear_sums

# the processors whose math LinearAttention repeats; any other on a "linear" module is refused by name
LINEAR_PROCESSORS = ("SanaLinearAttnProcessor2_0",)


class LinearAttention:
    """diffusers' SanaLinearAttnProcessor2_0 with the sums over tokens the strategy's (one per module)."""

    def __init__(self, state, name: str):
        self.state, self.name = state, name

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
        original_dtype = hidden_states.dtype
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        query = attn.to_q(hidden_states)
        key = attn.to_k(encoder_hidden_states)
        value = attn.to_v(encoder_hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = query.transpose(1, 2).unflatten(1, (attn.heads, -1))
        key = key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)
        value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))
        query, key = F.relu(query), F.relu(key)
        query, key, value = query.float(), key.float(), value.float()

        sums = self._sums(key, value)
        hidden_states = linear_output(sums, query)

        hidden_states = hidden_states.flatten(1, 2).transpose(1, 2).to(original_dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if original_dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states

    def _sums(self, key, value):
        state = self.state
        if not state.in_forward:  # a probe outside the parallel forward: the tokens it was given
            return linear_sums(key, value)
        if torch.compiler.is_compiling():
            return torch.ops.xdit_lab.linear_sums(key, value, state.handle, self.name)
        return state.strategy.linear_sums(self.name, key, value)


def install_linear_attention(module, name: str, state) -> None:
    """Replace `module`'s processor by LinearAttention (installed as "attention[<name>]"), after checking that
    it runs diffusers' linear attention, whose math ours repeats."""
    found = type(module.processor).__name__
    if found not in LINEAR_PROCESSORS:
        raise TypeError(
            f"attention module {name} runs {found}, not diffusers' linear attention ({', '.join(LINEAR_PROCESSORS)}), "
            f"whose sums over tokens xdit_lab reduces over the ranks; set its processor back to "
            f"{LINEAR_PROCESSORS[0]}() before parallelize"
        )
    processor = LinearAttention(state, name)
    state.hooks.replace(f"attention[{name}]", module, processor=processor)
    site = _Site(processor)
    state.sites.append((weakref.ref(module), site))


class _Site:
    """What check_sites (hooks.py) reads of an attended module: the processor it must still run."""

    through_dispatch = False

    def __init__(self, processor: LinearAttention):
        self.processor, self.name, self.kind = processor, processor.name, "linear"


@torch.library.custom_op("xdit_lab::linear_sums", mutates_args=())
def _linear_sums_op(key: torch.Tensor, value: torch.Tensor, state: int, name: str) -> torch.Tensor:
    return comm.from_handle(state).strategy.linear_sums(name, key, value)


@_linear_sums_op.register_fake
def _(key, value, state, name):
    batch, heads, _, head_dim = key.shape
    return key.new_empty((batch, heads, value.shape[2] + 1, head_dim))
