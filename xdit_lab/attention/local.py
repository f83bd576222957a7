"""Local attention that returns a true log-sum-exp, and the LSE merge of partial results.

Ring attention computes softmax(q·kᵀ)·v one K/V block at a time, so every block's result must
come with the log-sum-exp of its scores: merging two partial outputs weighs each by
exp(lse_block - lse_total). A backend that cannot return the LSE (or returns a fake zero, as
some CPU fallbacks do) silently breaks Ring; none of ours does.

Backends, chosen once per device type and reported by `attention_backend()`:
    flash_attn      flash-attn's kernel, on CUDA when the package imports (the fastest)
    sdpa_flash      torch's own flash kernel on CUDA (fp16/bf16, head_dim <= 256)
    sdpa_efficient  torch's memory-efficient kernel on CUDA (any float dtype)
    cpu_flash       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    math            explicit scores and logsumexp: slow, exact, any device (the reference)
Override with `set_attention_backend(name)` or the XDIT_LAB_ATTENTION environment variable.
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("xdit_lab.attention")

BACKENDS = ("flash_attn", "sdpa_flash", "sdpa_efficient", "cpu_flash", "math")
_override: str | None = None
_chosen: dict[str, str] = {}  # device type -> backend, decided on first use


def set_attention_backend(name: str | None) -> None:
    """Force a backend for every later call (None: choose automatically again)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    global _override
    _override = name
    _chosen.clear()


def attention_backend(device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> str:
    """The backend used for tensors on `device` (decided once per device type)."""
    device = torch.device(device)
    forced = _override or os.environ.get("XDIT_LAB_ATTENTION") or None
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"XDIT_LAB_ATTENTION={forced!r} is not a backend; choose one of {', '.join(BACKENDS)}")
        return forced
    if device.type not in _chosen:
        if device.type == "cuda":
            try:
                import flash_attn  # noqa: F401

                _chosen["cuda"] = "flash_attn"
            except ImportError:
                _chosen["cuda"] = "sdpa_flash"
        elif device.type == "cpu":
            _chosen["cpu"] = "cpu_flash"
        else:
            _chosen[device.type] = "math"
        log.info("attention backend for %s: %s", device.type, _chosen[device.type])
    backend = _chosen[device.type]
    # The flash kernels take half precision only; fall back per call, not for the whole device.
    if backend in ("flash_attn", "sdpa_flash") and dtype not in (torch.float16, torch.bfloat16):
        return "sdpa_efficient"
    return backend


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float | None = None):
    """softmax(q·kᵀ·scale)·v with its log-sum-exp.

    q [B, H, Sq, D], k and v [B, H, Sk, D] (SDPA layout). Returns out [B, H, Sq, D] in q's dtype
    and lse [B, H, Sq] in float32, natural log. Sk must be at least 1."""
    if k.shape[2] == 0:
        raise ValueError("local_attention needs at least one key (the CPU kernel crashes on none)")
    backend = attention_backend(q.device, q.dtype)
    if backend == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
    elif backend == "sdpa_flash" and q.shape[-1] <= 256:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    elif backend in ("sdpa_flash", "sdpa_efficient"):
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False,
                                                                         scale=scale)[:2]
        lse = lse[..., : q.shape[2]]  # the efficient kernel pads its LSE to a multiple of 32 rows
    elif backend == "flash_attn":
        from flash_attn import flash_attn_func

        out, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                      softmax_scale=scale, return_attn_probs=True)
        out = out.transpose(1, 2)
    else:
        out, lse = _math_attention(q, k, v, scale)
    return out, lse.float()


def joint_local_attention(q, k, v, *, joint=None, scale=None):
    """Attention over the whole (gathered) sequence on one rank, image and text in one call.

    joint: optional (q, k, v) of text tokens, appended after the image tokens. Returns
    (image_out, text_out or None)."""
    if joint is None:
        return local_attention(q, k, v, scale=scale)[0], None
    image_len = q.shape[2]
    q, k, v = (torch.cat([image, text], dim=2) for image, text in zip((q, k, v), joint))
    out = local_attention(q, k, v, scale=scale)[0]
    return out[:, :, :image_len], out[:, :, image_len:]


def _math_attention(q, k, v, scale):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse


def merge_attention(out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor,
                    block_lse: torch.Tensor):
    """Fold one block's partial result into a running (out, lse), as online softmax does.

    The running output is kept in float32 so that many merges do not lose bf16 precision."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    out = out * torch.exp(lse - new_lse).unsqueeze(-1) + block_out.float() * torch.exp(block_lse - new_lse).unsqueeze(-1)
    return out, new_lse
