"""One GPU: every attention kernel's output and log-sum-exp against the math kernel, the block
merge, serial pipelines against diffusers in float32 and bfloat16, two processes sharing the GPU
over gloo (Ulysses, Ring, CFG, dp: NCCL refuses two ranks on one GPU; gloo's collectives move CUDA
tensors, and Ring's sends and receives go through host copies), and the Lab's one engine reconfigured with flat memory."""

import math

import pytest
import torch
from gpu_tier import LSE_BOUND, OUT_BOUND, relative_error, serial_pipeline, shared_gpu_models, sp_attention_on_gpu

from xdit_lab.attention import local_attention, merge_attention, set_attention_backend
from xdit_lab.attention.local import BACKENDS, _flash_attn_installed, attention_backend, why_not

GPUS_NEEDED = 1
DTYPES = ["float32", "float16", "bfloat16"]
HEAD_DIMS = [64, 72, 128]
BF16_PIPELINE_BOUND = 5e-2  # relative L2 of bf16 latents after 3 steps (H200: 0 for all four; CPU: up to 0.020)


def _qkv(dtype, head_dim, seq_q=333, seq_k=517, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(2, 4, n, head_dim, generator=g).to("cuda", getattr(torch, dtype)) for n in (seq_q, seq_k, seq_k)
    ]


@pytest.fixture
def forced():
    yield set_attention_backend
    set_attention_backend(None)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", [b for b in BACKENDS if b not in ("cpu_flash", "math")])
def test_kernel_output_and_lse_agree_with_math(backend, dtype, head_dim, forced, figures):
    q, k, v = _qkv(dtype, head_dim)
    capability = torch.cuda.get_device_capability()
    if backend == "flash_attn" and not _flash_attn_installed():
        pytest.skip("flash-attn is not installed (make setup-gpu): its kernel did not run")
    why = why_not(backend, "cuda", getattr(torch, dtype), head_dim, capability, _flash_attn_installed())
    forced(backend)
    if why:  # the rule says this kernel cannot run it: forcing it must say so, not crash in the kernel
        with pytest.raises(ValueError, match="cannot run"):
            local_attention(q, k, v)
        figures(refused=why)
        return
    out, lse = local_attention(q, k, v)
    forced("math")
    reference, reference_lse = local_attention(q, k, v)
    out_error, lse_error = relative_error(out, reference), (lse - reference_lse).abs().max().item()
    figures(out_error=out_error, lse_error=lse_error)
    assert out.dtype == q.dtype and lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    assert out_error <= OUT_BOUND[dtype] and lse_error <= LSE_BOUND[dtype]
    # controls: an LSE in base 2, or none, and attention over half the keys must fail the bounds
    assert (lse / math.log(2) - reference_lse).abs().max() > LSE_BOUND[dtype]
    assert (torch.zeros_like(lse) - reference_lse).abs().max() > LSE_BOUND[dtype]
    assert relative_error(local_attention(q, k[:, :, :256], v[:, :, :256])[0], reference) > OUT_BOUND[dtype]


@pytest.mark.parametrize("head_dim", HEAD_DIMS + [20])
@pytest.mark.parametrize("dtype", DTYPES)
def test_automatic_choice_runs_and_agrees(dtype, head_dim, figures):
    q, k, v = _qkv(dtype, head_dim)
    chosen = attention_backend(q.device, q.dtype, head_dim)
    out, lse = local_attention(q, k, v)
    set_attention_backend("math")
    try:
        reference, reference_lse = local_attention(q, k, v)
    finally:
        set_attention_backend(None)
    figures(
        backend=chosen, out_error=relative_error(out, reference), lse_error=(lse - reference_lse).abs().max().item()
    )
    assert relative_error(out, reference) <= OUT_BOUND[dtype]
    assert (lse - reference_lse).abs().max() <= LSE_BOUND[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_merge_is_exact_and_syncs_nothing(dtype, figures):
    """Keys in three blocks merged with their LSE equal the kernel on all keys (in float32 with the math
    kernel, to float rounding); an empty block is a bit-exact no-op; nothing waits on the host."""
    q, k, v = _qkv(dtype, 64)
    whole, whole_lse = local_attention(q, k, v)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host sync now raises
    try:
        out = lse = None
        for kb, vb in zip(k.split([100, 300, 117], dim=2), v.split([100, 300, 117], dim=2)):
            out, lse = merge_attention(out, lse, *local_attention(q, kb, vb))
        empty = (torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"), device="cuda"))
        same, same_lse = merge_attention(out, lse, *empty)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(same, out) and torch.equal(same_lse, lse)
    error = relative_error(out, whole)
    figures(merge_error=error, lse_error=(lse - whole_lse).abs().max().item())
    assert error <= OUT_BOUND[dtype] and (lse - whole_lse).abs().max() <= LSE_BOUND[dtype]
    set_attention_backend("math")
    try:
        q32, k32, v32 = (t.float() for t in (q, k, v))
        exact, _ = local_attention(q32, k32, v32)
        out = lse = None
        for kb, vb in zip(k32.split([100, 300, 117], dim=2), v32.split([100, 300, 117], dim=2)):
            out, lse = merge_attention(out, lse, *local_attention(q32, kb, vb))
    finally:
        set_attention_backend(None)
    assert relative_error(out, exact) < 1e-5


def test_memory_plan_counts_this_process_cached_blocks_as_free(figures):
    from xdit_lab.plan import available_bytes

    device = torch.device("cuda", 0)
    block = torch.empty(1 << 30, dtype=torch.uint8, device=device)  # 1 GiB, then back to torch's cache
    del block
    free = torch.cuda.mem_get_info(device)[0]
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    available = available_bytes(device)
    figures(cached_gib=cached / 2**30, counted_gib=(available - free) / 2**30)
    assert cached >= 1 << 30
    assert available >= free + (1 << 30) - (64 << 20)  # the cached GiB counts (other processes may move free)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["pixart", "sd3", "flux", "cogvideox"])
def test_world_of_one_pipeline_equals_diffusers(family, dtype, tmp_path, figures):
    from xdit_lab.testing import run_on_ranks
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline(family, tmp_path / family)
    result = run_on_ranks(serial_pipeline, 1, str(folder), family, dtype, backend="nccl", timeout_s=300)[0]
    figures(error=result["error"], rel_l2=result["l2"], control_l2=result["control_l2"])
    assert result["device"] == "cuda:0" and result["dtype"] == f"torch.{dtype}"
    if dtype == "float32":
        assert result["error"] <= 1e-4
    else:  # bf16: our attention kernels against diffusers' SDPA, rounding differently over 3 steps
        assert result["l2"] <= BF16_PIPELINE_BOUND  # on CPU: pixart, sd3 0, flux 0.002, cogvideox 0.020
    assert result["control_l2"] > BF16_PIPELINE_BOUND  # control: another seed's latents (on CPU: 1.2 to 1.4)


@pytest.mark.parametrize("degrees", [dict(ulysses=2), dict(ring=2)], ids=["ulysses2", "ring2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_processes_share_the_gpu_over_gloo_attention(dtype, degrees, figures):
    from xdit_lab.testing import run_on_ranks

    results = run_on_ranks(sp_attention_on_gpu, 2, dtype, degrees, "cuda:0", backend="gloo", timeout_s=180)
    bound = 1e-4 if dtype == "float32" else OUT_BOUND[dtype]
    for rank, result in enumerate(results):
        figures(
            **{f"rank{rank} {k}": v for k, v in result["errors"].items()}, **{f"rank{rank} control": result["control"]}
        )
        assert result["device"] == "cuda:0" and result["dtype"] == f"torch.{dtype}"
        assert max(result["errors"].values()) <= bound
        assert result["control"] > bound  # a rank attending to its own keys only (no exchange) is caught


@pytest.mark.parametrize("family", ["pixart", "flux"])
def test_two_processes_share_the_gpu_over_gloo_models(family, figures):
    from xdit_lab.testing import run_on_ranks

    names = ["ulysses", "ring", "cfg", "dp"]
    for rank, rows in enumerate(run_on_ranks(shared_gpu_models, 2, family, names, backend="gloo", timeout_s=240)):
        for name, row in rows.items():
            figures(**{f"{name} rank{rank}": row["error"]})
            assert row["device"] == "cuda:0"
            assert row["error"] <= 1e-4, (name, row)
            assert name in row["groups"], (name, row)  # the degree's traffic is in its group's records


def test_lab_with_one_engine_reconfigured_keeps_memory_flat(tmp_path, monkeypatch, figures):
    """Five reloads on one GPU engine: the same allocated bytes and process groups after each, the old
    transformer gone each time, and each session's peak its own (a small one after a large one)."""
    from xdit_lab import ParallelConfig
    from xdit_lab.lab import Lab, engine
    from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    kwargs = dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2, seed=0)
    with Lab(n=1, timeout_s=180, collective_timeout_s=60) as lab:
        assert lab.ranks[0]["device"] == "cuda:0"
        lab.load(folder, ParallelConfig(), progress=False)
        after = []
        for _ in range(5):
            lab.call(engine.watch_transformer)
            lab.configure(ParallelConfig())
            assert lab.call(engine.watched_alive) == {0: False}
            lab.session("a red cat", **kwargs).run().result(output_type="latent")
            after.append(lab.call(engine.memory)[0])
        lab.session("a red cat", **dict(kwargs, height=128, width=128)).run().result(output_type="latent")
        large = lab.call(engine.memory)[0]["max_allocated"]
        lab.session("a red cat", **dict(kwargs, height=16, width=16)).run().result(output_type="latent")
        small = lab.call(engine.memory)[0]["max_allocated"]
    figures(
        allocated=[m["allocated"] for m in after],
        reserved_mib=after[-1]["reserved"] / 2**20,
        peak_large=large,
        peak_small=small,
    )
    assert len({m["allocated"] for m in after}) == 1, after
    assert len({m["process_groups"] for m in after}) == 1, after
    assert after[-1]["reserved"] <= after[0]["reserved"] + (32 << 20), after
    assert small < large  # before: the peak was never reset, so it stayed at the large session's
