"""Local attention that returns a true log-sum-exp, and the LSE merge of partial results.

Ring attention computes softmax(q·kᵀ)·v one K/V block at a time, so every block's result must
come with the log-sum-exp of its scores: merging two partial outputs weighs each by
exp(lse_block - lse_total). A backend that cannot return the LSE (or returns a fake zero, as
some CPU fallbacks do) silently breaks Ring; none of ours does.

Backends, reported by `attention_backend(device, dtype, head_dim)`:
    flash_attn      flash-attn's kernel, on CUDA when the package imports (the fastest)
    sdpa_flash      torch's own flash kernel on CUDA
    sdpa_efficient  torch's memory-efficient kernel on CUDA
    cpu_flash       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    math            explicit scores and logsumexp: slow, exact, any device (the reference)
What each kernel accepts is written once, in `why_not(...)`, a pure function of the device
type, dtype, head_dim, GPU compute capability and whether the call masks keys: the flash kernels
take float16/bfloat16 on Ampere or newer (capability 8.0+), torch's with head_dim a multiple of 8
up to 256. The first
backend that accepts a call runs it (a fallback is logged with its reason, once). Force one with
`set_attention_backend(name)` or the XDIT_LAB_ATTENTION environment variable: a forced backend
that cannot run a call raises, saying why and which backends can.

Where no log-sum-exp is needed (attention over the whole sequence: Ulysses' heads, a single rank)
`attention(...)` calls torch's own F.scaled_dot_product_attention, which picks flash or cuDNN on a
GPU; only Ring's blocks need `local_attention`'s LSE, and `merge_stacked` folds all of a query's
partial results in one go (a fixed handful of operations, however many blocks there were).

Key masks (`key_mask`, [B, Sk] bool, True: attend) exist for padded text only (Qwen-Image,
HunyuanVideo). Without an LSE, SDPA takes the mask itself. With one, the image keys are attended
unmasked with the fastest kernel and the few text keys in a separate masked call (cpu_flash or
math), merged by LSE, so a mask never slows the image part.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

log = logging.getLogger("xdit_lab.attention")

BACKENDS = ("flash_attn", "sdpa_flash", "sdpa_efficient", "cpu_flash", "math")
PREFERENCE = {"cuda": ("flash_attn", "sdpa_flash", "sdpa_efficient", "math"), "cpu": ("cpu_flash", "math")}
HALF = (torch.float16, torch.bfloat16)
_override: str | None = None


def set_attention_backend(name: str | None) -> None:
    """Force a backend for every later call (None: choose automatically again)."""
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    global _override
    _override = name
    _decide.cache_clear()


def why_not(
    backend: str,
    device_type: str,
    dtype: torch.dtype,
    head_dim: int | None = None,
    capability: tuple[int, int] | None = None,
    flash_attn_installed: bool = False,
    masked: bool = False,
) -> str | None:
    """Why `backend` cannot run attention on these tensors, or None when it can.

    head_dim None skips the head_dim rules; capability is the GPU's (major, minor); masked: the call
    has a key mask."""
    if backend == "math":
        return None
    if backend == "cpu_flash":
        return None if device_type == "cpu" else f"it runs on CPU tensors only, not {device_type}"
    if device_type != "cuda":
        return f"it needs CUDA tensors, not {device_type}"
    if masked:  # flash kernels take no mask; the efficient one's bias needs padding we do not do
        return "xdit_lab hands key masks (padded text) only to cpu_flash and math"
    major, minor = capability or (0, 0)
    if backend == "flash_attn" and not flash_attn_installed:
        return "the flash-attn package is not installed (README: On a CUDA machine)"
    if backend in ("flash_attn", "sdpa_flash"):
        if dtype not in HALF:
            return f"it takes float16 or bfloat16, not {str(dtype).replace('torch.', '')}"
        if major < 8:
            return f"it needs an Ampere or newer GPU (compute capability 8.0+), this one is {major}.{minor}"
        if head_dim is not None and head_dim > 256:
            return f"it takes head_dim up to 256, not {head_dim}"
        if backend == "sdpa_flash" and head_dim is not None and head_dim % 8:
            return f"torch's flash op needs head_dim a multiple of 8, not {head_dim}"
        return None
    if backend == "sdpa_efficient":
        if dtype not in (torch.float32, *HALF):
            return f"it takes float32, float16 or bfloat16, not {str(dtype).replace('torch.', '')}"
        if dtype == torch.bfloat16 and major < 8:
            return f"bfloat16 needs compute capability 8.0+, this GPU is {major}.{minor}"
        # torch's own dispatcher asks this alignment of head_dim (the GEMM tiles' minimum)
        align = 8 if (dtype in HALF and major >= 7) else 4 if major >= 8 else 1
        if head_dim is not None and head_dim % align:
            return (
                f"it needs head_dim a multiple of {align} for {str(dtype).replace('torch.', '')} here, not {head_dim}"
            )
        return None
    raise ValueError(f"unknown attention backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def attention_backend(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    head_dim: int | None = None,
    masked: bool = False,
) -> str:
    """The backend that runs attention on tensors of this device, dtype and head_dim (with a key
    mask when masked)."""
    device = torch.device(device)
    forced = _override or os.environ.get("XDIT_LAB_ATTENTION") or None
    capability = _capability(device.index) if device.type == "cuda" else None
    installed = _flash_attn_installed() if device.type == "cuda" else False
    return _decide(device.type, dtype, head_dim, capability, installed, forced, masked)


@functools.cache
def _decide(device_type, dtype, head_dim, capability, flash_attn_installed, forced, masked=False) -> str:
    """The first backend of this device type's preference that can run the call (cached per kind of call)."""
    where = f"{str(dtype).replace('torch.', '')} tensors with head_dim {head_dim} on {device_type}" + (
        f" (compute capability {capability[0]}.{capability[1]})" if capability else ""
    )
    where += " with a key mask" if masked else ""
    reasons = {
        name: why_not(name, device_type, dtype, head_dim, capability, flash_attn_installed, masked)
        for name in PREFERENCE.get(device_type, ("math",))
    }
    if forced:
        if forced not in BACKENDS:
            raise ValueError(f"XDIT_LAB_ATTENTION={forced!r} is not a backend; choose one of {', '.join(BACKENDS)}")
        why = why_not(forced, device_type, dtype, head_dim, capability, flash_attn_installed, masked)
        if why:
            able = [name for name, reason in reasons.items() if reason is None]
            raise ValueError(
                f"attention backend {forced!r} is forced (XDIT_LAB_ATTENTION or set_attention_backend) "
                f"but cannot run {where}: {why}. Backends that can: {', '.join(able)}; or unset it to "
                f"choose automatically"
            )
        return forced
    skipped = []
    for name, reason in reasons.items():  # in order of preference; math always runs
        if reason is None:
            log.info("attention backend for %s: %s%s", where, name, f" (not {'; '.join(skipped)})" if skipped else "")
            return name
        skipped.append(f"{name}: {reason}")


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _flash_attn_installed() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def local_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    key_mask: torch.Tensor | None = None,
):
    """softmax(q·kᵀ·scale)·v with its log-sum-exp.

    q [B, H, Sq, D], k and v [B, H, Sk, D] (SDPA layout). Returns out [B, H, Sq, D] in q's dtype
    and lse [B, H, Sq] in float32, natural log. Sk must be at least 1. key_mask: optional [B, Sk]
    bool, True where a key is attended; a sample with no key left gives out 0 and lse -inf, which
    merge_attention weighs 0."""
    if k.shape[2] == 0:
        raise ValueError("local_attention needs at least one key (the CPU kernel crashes on none)")
    backend = attention_backend(q.device, q.dtype, q.shape[-1], masked=key_mask is not None)
    if key_mask is not None:
        return _masked_attention(q, k, v, key_mask, scale, backend)
    if backend == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)[:2]
    elif backend == "sdpa_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)[:2]
    elif backend == "sdpa_efficient":
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)[
            :2
        ]
        lse = lse[..., : q.shape[2]]  # the efficient kernel pads its LSE to a multiple of 32 rows
    elif backend == "flash_attn":
        from flash_attn import flash_attn_func

        out, lse, _ = flash_attn_func(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale, return_attn_probs=True
        )
        out = out.transpose(1, 2)
    else:
        out, lse = _math_attention(q, k, v, scale)
    return out, lse.float()


def attention(q, k, v, *, scale: float | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(q·kᵀ·scale)·v without its log-sum-exp: where no merge follows (a whole sequence on one
    rank, Ulysses' heads), torch's F.scaled_dot_product_attention runs it, and picks its fastest kernel
    (flash or cuDNN on a GPU; with a key mask, one that takes a mask). A backend forced with
    set_attention_backend or XDIT_LAB_ATTENTION runs instead. q [B, H, Sq, D], k and v [B, H, Sk, D],
    any strides; key_mask: optional [B, Sk] bool, True where a key is attended (every query row must
    keep at least one key)."""
    if _override or os.environ.get("XDIT_LAB_ATTENTION"):
        return local_attention(q, k, v, scale=scale, key_mask=key_mask)[0]
    mask = None if key_mask is None else key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def joint_local_attention(q, k, v, *, joint=None, joint_mask=None, scale=None):
    """Attention over the whole (gathered) sequence on one rank, image and text in one call.

    joint: optional (q, k, v) of text tokens, appended after the image tokens; joint_mask: optional
    [B, T] bool over the text keys (True: attend), which makes it two calls merged by LSE: image keys
    unmasked, text keys masked. Returns (image_out, text_out or None)."""
    if joint is None:
        return attention(q, k, v, scale=scale), None
    image_len = q.shape[2]
    if joint_mask is None:
        q, k, v = (torch.cat([image, text], dim=2) for image, text in zip((q, k, v), joint))
        out = attention(q, k, v, scale=scale)
    else:
        q = torch.cat([q, joint[0]], dim=2)
        parts = [local_attention(q, k, v, scale=scale)]
        if joint[1].shape[2]:
            parts.append(local_attention(q, joint[1], joint[2], scale=scale, key_mask=joint_mask))
        out = merge_stacked(parts, q.dtype)
    return out[:, :, :image_len], out[:, :, image_len:]


def _math_attention(q, k, v, scale, bias=None):
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if bias is not None:
        scores = scores + bias
    lse = torch.logsumexp(scores, dim=-1)
    weights = torch.exp(scores - torch.where(lse == float("-inf"), 0.0, lse).unsqueeze(-1))
    out = torch.matmul(weights, v.float())
    return out.to(q.dtype), lse


def _masked_attention(q, k, v, key_mask, scale, backend):
    """Attention with a key-padding mask, as an additive bias of 0 or -inf. A sample whose keys are
    all masked gets out 0 and lse -inf from the mask itself (no host sync): the CPU kernel would
    report lse 0 for it, which a merge would weigh as a real block."""
    if key_mask.dtype != torch.bool or key_mask.shape != (q.shape[0], k.shape[2]):
        raise ValueError(
            f"key_mask must be bool [batch, keys] = [{q.shape[0]}, {k.shape[2]}], got {key_mask.dtype} "
            f"{tuple(key_mask.shape)}"
        )
    bias = torch.zeros(key_mask.shape, dtype=torch.float32, device=q.device).masked_fill(~key_mask, float("-inf"))
    bias = bias[:, None, None, :]
    if backend == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=bias.to(q.dtype), scale=scale
        )[:2]
    else:
        out, lse = _math_attention(q, k, v, scale, bias)
    dead = ~key_mask.any(dim=1)[:, None, None]  # [B, 1, 1]
    return out.masked_fill(dead[..., None], 0.0), lse.float().masked_fill(dead, float("-inf"))


def merge_attention(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
):
    """Fold one block's partial result into a running (out, lse), as online softmax does.

    The running output is kept in float32 so that many merges do not lose bf16 precision. A block
    with lse -inf (no keys) weighs exp(-inf) = 0: merging it changes nothing, so callers need no
    test (a host sync on a GPU) to skip it. Where both sides are -inf the total is -inf too, and
    the weights are taken against 0 instead, giving 0 rather than exp(nan)."""
    if out is None:
        return block_out.float(), block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    reference = torch.where(new_lse == float("-inf"), 0.0, new_lse)  # the safe exponent base
    out = out * torch.exp(lse - reference).unsqueeze(-1) + block_out.float() * torch.exp(
        block_lse - reference
    ).unsqueeze(-1)
    return out, new_lse


def merge_stacked(parts, dtype: torch.dtype | None = None, *, token_major: bool = False) -> torch.Tensor:
    """One query block's partial results over several key blocks, [(out [B, H, S, D], lse [B, H, S])],
    merged in one go: softmax over the blocks' log-sum-exps weighs each output. The same handful of
    operations whatever the number of parts (Ring's merge is O(1) operations, not one chain per
    block), in float32, returned in `dtype` (the first output's when None). A part with lse -inf (no
    key attended) weighs 0; where every part is -inf the result is 0, not nan. token_major: the result
    lies in memory as [B, S, H, D] (returned as its [B, H, S, D] view), the layout the model's own
    projection reads."""
    dtype = dtype or parts[0][0].dtype
    if len(parts) == 1:
        out = parts[0][0].to(dtype)
        return out.transpose(1, 2).contiguous().transpose(1, 2) if token_major else out
    if len(parts) == 2:
        return _merge_two(parts, dtype, token_major)
    # token-major: the kernels' outputs lie as [B, S, H, D] already (flash kernels write them so)
    outs = torch.stack([out.transpose(1, 2) if token_major else out for out, _ in parts])  # [P, B, S|H, H|S, D]
    lses = torch.stack([lse for _, lse in parts])  # [P, B, H, S], float32
    weights = torch.softmax(lses, dim=0).nan_to_num_(0.0)  # exp(lse_p - logsumexp); all -inf: nan, taken as 0
    if token_major:
        weights = weights.transpose(2, 3)
    out = (weights.unsqueeze(-1) * outs).sum(dim=0).to(dtype)  # float32 until here
    return out.transpose(1, 2) if token_major else out


def _merge_two(parts, dtype: torch.dtype, token_major: bool) -> torch.Tensor:
    """merge_stacked of two parts (Ring 2, a masked text beside the image) in four kernels instead of a
    dozen: the second part's weight is exp(lse1) / (exp(lse0) + exp(lse1)) = sigmoid(lse1 - lse0), and
    out = lerp(out0, out1, weight). A part with lse -inf weighs 0 (sigmoid of -inf or +inf); where both
    are -inf (no key at all) the weight's nan is taken as 0, and both outputs are 0 there."""
    (out0, lse0), (out1, lse1) = parts
    weight = torch.sigmoid(lse1 - lse0).nan_to_num_(0.0).unsqueeze(-1)  # [B, H, S, 1], float32
    batch, heads, tokens, head_dim = out0.shape
    if token_major:
        out = torch.empty(batch, tokens, heads, head_dim, device=out0.device).transpose(1, 2)
    else:
        out = torch.empty(batch, heads, tokens, head_dim, device=out0.device)
    torch.lerp(out0.float(), out1.float(), weight, out=out)
    return out.to(dtype)
