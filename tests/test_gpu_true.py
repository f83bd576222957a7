"""The CUDA/NCCL path made right on paper, checked on CPU wherever its logic runs there (issue 15).

Each test names what went wrong before: diffusers' attention backends bypassing the parallel
kernels, forced kernels that cannot run, host syncs in Ring's merge, groups without the world's
timeout or never destroyed, models kept alive by their own forward, PipeFusion's message order
and dtypes, and the Lab's engine count on a GPU host. What needs a GPU is in tests/gpu/."""

import gc
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from xdit_lab import ParallelConfig, RankMesh, comm, parallelize
from xdit_lab.attention import local_attention, merge_attention, set_attention_backend, sp_attention
from xdit_lab.attention.local import attention_backend, why_not
from xdit_lab.mesh import GROUP_NAMES
from xdit_lab.sharding import take_shard
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_inputs, tiny_pipeline_kwargs, tiny_transformer

REPO = Path(__file__).resolve().parents[1]


# ---- diffusers' attention backends: refused or exact, never a shard-only result ----------------------


def _flux_error(backend=None, config=None):
    """Relative error of tiny Flux parallelized after set_attention_backend(backend), against its serial
    forward with the default backend; and the warnings parallelize logged."""
    config = config or ParallelConfig(ulysses=2)
    model = tiny_transformer("flux", seed=0)
    inputs = tiny_inputs("flux", 2, text_len=6)
    with torch.no_grad():
        reference = model(**inputs).sample
    if backend:
        model.set_attention_backend(backend)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("xdit_lab.models").addHandler(handler)
    try:
        model = parallelize(model, config, RankMesh(config))
    finally:
        logging.getLogger("xdit_lab.models").removeHandler(handler)
    with torch.no_grad():
        output = model(**inputs).sample
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    return dict(
        error=((output - reference).norm() / reference.norm()).item(),
        warnings=[r.getMessage() for r in records],
        active=_AttentionBackendRegistry._active_backend.value,
    )


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_flux_set_to_flex_attention_is_exact_under_ulysses():
    """Before: flex never reached F.scaled_dot_product_attention, each rank attended to its own shard,
    and the output was 1.6% off with no error."""
    for result in run_on_ranks(_flux_error, 2, "flex", timeout_s=180):
        assert result["error"] < 1e-4, result
        assert any("'flex'" in w and "registered backend 'xdit_lab'" in w for w in result["warnings"]), result[
            "warnings"
        ]


def test_diffusers_attn_backend_variable_is_exact_under_ulysses():
    """DIFFUSERS_ATTN_BACKEND is read when diffusers is imported, so the ranks must start with it set:
    a fresh Python process whose forkserver imports diffusers under it."""
    code = (
        "import sys; sys.path.insert(0, 'tests'); import test_gpu_true as t; "
        "from xdit_lab.testing import run_on_ranks; "
        "print(repr(run_on_ranks(t._flux_error, 2, None, timeout_s=180)))"
    )
    env = dict(os.environ, DIFFUSERS_ATTN_BACKEND="flex", PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    results = eval(done.stdout.strip().splitlines()[-1])  # noqa: S307 (our own repr of floats and strings)
    for result in results:
        assert result["active"] == "flex", result  # the variable really was in force
        assert result["error"] < 1e-4, result
        assert any("'flex'" in w for w in result["warnings"]), result


def _attention_swapped_after_parallelize():
    """A known module's attention changed after parallelize (its processor's backend set to flex):
    the call-time guard must raise rather than return a shard-only result."""
    config = ParallelConfig(ulysses=2)
    model = parallelize(tiny_transformer("flux", seed=0), config, RankMesh(config))
    model.transformer_blocks[0].attn.processor._attention_backend = "flex"
    try:
        with torch.no_grad():
            model(**tiny_inputs("flux", 2, text_len=6))
    except RuntimeError as error:
        return str(error)
    return None


def _processor_replaced_after_parallelize():
    """SD3's processor calls F.scaled_dot_product_attention itself: parallelize runs a copy of it bound to
    the kernels; a stock processor set back on one module after parallelize must be caught the same way."""
    from diffusers.models.attention_processor import JointAttnProcessor2_0

    config = ParallelConfig(ulysses=2)
    model = parallelize(tiny_transformer("sd3", seed=0), config, RankMesh(config))
    model.transformer_blocks[1].attn.processor = JointAttnProcessor2_0()
    try:
        with torch.no_grad():
            model(**tiny_inputs("sd3", 2, text_len=6))
    except RuntimeError as error:
        return str(error)
    return None


def _backend_set_after_parallelize():
    """model.set_attention_backend("flex") after parallelize: diffusers' own check refuses it, because the
    processors carry xdit_lab's site as their parallel config."""
    config = ParallelConfig(ulysses=2)
    model = parallelize(tiny_transformer("flux", seed=0), config, RankMesh(config))
    try:
        model.set_attention_backend("flex")
    except ValueError as error:
        return str(error)
    return None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_attention_that_bypasses_the_kernels_at_call_time_raises():
    for message in run_on_ranks(_attention_swapped_after_parallelize, 2, timeout_s=180):
        assert message and "transformer_blocks.0.attn" in message and "own shard" in message, message
    for message in run_on_ranks(_processor_replaced_after_parallelize, 2, timeout_s=180):
        assert message and "transformer_blocks.1.attn" in message and "own shard" in message, message
    for message in run_on_ranks(_backend_set_after_parallelize, 2, timeout_s=180):
        assert message and "does not support context parallelism" in message, message


def _nothing_intercepted_without_sp(family):
    """cfg 2 (and no sequence parallelism): no processor is touched, a user's flex backend stays, and the
    output equals serial; ulysses 2 beside it: every self/joint processor is xdit_lab's."""
    model = tiny_transformer(family, seed=0)
    inputs = tiny_inputs(family, 2, text_len=6)
    with torch.no_grad():
        reference = model(**inputs).sample
    if family == "flux":
        model.set_attention_backend("flex")
    before = {name: (type(m.processor), getattr(m.processor, "_attention_backend", None)) for name, m in _attn(model)}
    model = parallelize(model, ParallelConfig(cfg=2), RankMesh(ParallelConfig(cfg=2)))
    after = {name: (type(m.processor), getattr(m.processor, "_attention_backend", None)) for name, m in _attn(model)}
    with torch.no_grad():
        error = ((model(**inputs).sample - reference).abs().max() / reference.abs().max()).item()
    sp_model = parallelize(
        tiny_transformer(family, seed=0), ParallelConfig(ulysses=2), RankMesh(ParallelConfig(ulysses=2))
    )
    return dict(
        unchanged=before == after,
        error=error,
        taken_without_sp=[name for name, m in _attn(model) if _taken(m.processor)],
        taken_with_sp={name: _taken(m.processor) for name, m in _attn(sp_model)},
    )


def _taken(processor) -> bool:
    """Whether a processor runs xdit_lab's attention: pointed at the registered "xdit_lab" backend with an
    AttentionSite as its parallel config, or a copy whose code finds another F than torch's functional."""
    from xdit_lab.models.hooks import BACKEND_NAME, AttentionSite

    if getattr(processor, "_attention_backend", None) == BACKEND_NAME:
        return isinstance(processor._parallel_config, AttentionSite)
    return type(processor).__call__.__globals__.get("F") is not F


def _attn(model):
    return [(name, m) for name, m in model.named_modules() if name.endswith(".attn") and hasattr(m, "processor")]


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_no_attention_is_intercepted_without_sequence_parallelism(family):
    """cfg/dp-only runs leave diffusers' attention exactly as it was (no backend, no processor copy), so a
    user's backend keeps running there and is exact; the control, ulysses 2, takes every one over."""
    for result in run_on_ranks(_nothing_intercepted_without_sp, 2, family, timeout_s=180):
        assert result["unchanged"] and not result["taken_without_sp"] and result["error"] < 1e-5, result
        assert result["taken_with_sp"] and all(result["taken_with_sp"].values()), result


# ---- local kernels: what each accepts, and forced backends that cannot run ------------------------------


def test_backend_fallback_rules():
    cpu = [
        attention_backend("cpu", dtype, head_dim)
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
        for head_dim in (16, 20, 72, 300)
    ]
    assert set(cpu) == {"cpu_flash"}

    def cuda(dtype, head_dim, capability, flash_attn=False):
        from xdit_lab.attention.local import _decide

        return _decide("cuda", dtype, head_dim, capability, flash_attn, None)

    hopper, turing = (9, 0), (7, 5)
    assert cuda(torch.bfloat16, 64, hopper, flash_attn=True) == "flash_attn"
    assert cuda(torch.bfloat16, 72, hopper) == "sdpa_flash"
    assert cuda(torch.float32, 64, hopper, flash_attn=True) == "sdpa_efficient"  # flash kernels: half only
    assert cuda(torch.float16, 20, hopper) == "math"  # torch's flash op: head_dim % 8; efficient: same alignment
    assert cuda(torch.float16, 64, turing) == "sdpa_efficient"  # flash kernels need Ampere
    assert cuda(torch.bfloat16, 64, turing) == "math"  # and so does bf16 in the efficient kernel
    assert cuda(torch.float16, 320, hopper) == "sdpa_efficient"  # beyond the flash kernels' 256
    assert cuda(torch.float16, 300, hopper) == "math"
    assert "Ampere" in why_not("sdpa_flash", "cuda", torch.float16, 64, turing)
    assert "multiple of 8" in why_not("sdpa_flash", "cuda", torch.float16, 20, hopper)
    assert "not installed" in why_not("flash_attn", "cuda", torch.float16, 64, hopper, flash_attn_installed=False)


@pytest.mark.parametrize("forced", ["sdpa_flash", "sdpa_efficient", "flash_attn"])
def test_a_forced_backend_that_cannot_run_raises_saying_why(forced, monkeypatch):
    """Before: a forced backend skipped every check and reached a CUDA-only op with CPU tensors."""
    q = torch.randn(1, 2, 6, 8, generator=torch.Generator().manual_seed(0))
    monkeypatch.setenv("XDIT_LAB_ATTENTION", forced)
    with pytest.raises(
        ValueError,
        match=f"'{forced}' is forced .* cannot run float32 tensors with head_dim 8 on "
        f"cpu: it needs CUDA tensors.*Backends that can: cpu_flash, math",
    ):
        local_attention(q, q, q)
    monkeypatch.delenv("XDIT_LAB_ATTENTION")
    try:
        set_attention_backend(forced)
        with pytest.raises(ValueError, match="cannot run"):
            local_attention(q, q, q)
        set_attention_backend("math")  # a forced backend that can run does
        out, _ = local_attention(q, q, q)
    finally:
        set_attention_backend(None)
    assert (out - F.scaled_dot_product_attention(q, q, q)).abs().max() < 1e-5  # float32 rounding


# ---- Ring: the merge needs no host-side test ------------------------------------------------------------


def test_merging_an_empty_block_is_a_no_op_and_never_nan():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8, generator=g) for _ in range(3))
    out, lse = merge_attention(None, None, *local_attention(q, k, v))
    empty_out, empty_lse = torch.zeros_like(q), torch.full(q.shape[:3], float("-inf"))
    merged_out, merged_lse = merge_attention(out, lse, empty_out, empty_lse)
    assert torch.equal(merged_out, out) and torch.equal(merged_lse, lse)  # bit for bit
    # two empty blocks: no keys at all; zeros, not exp(nan)
    none_out, none_lse = merge_attention(*merge_attention(None, None, empty_out, empty_lse), empty_out, empty_lse)
    assert not none_out.isnan().any() and torch.equal(none_out, torch.zeros_like(none_out))
    assert torch.isneginf(none_lse).all()


HOST_SYNCS = {
    torch.Tensor.__bool__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
}


class _HostSyncs(TorchFunctionMode):
    """Records tensor calls that read a value back to the host (a stream sync on a GPU)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_SYNCS:
            self.seen.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _ring_host_syncs(seq_len):
    mesh = RankMesh(ParallelConfig(ring=2))
    g = torch.Generator().manual_seed(0)
    image = [torch.randn(1, 2, seq_len, 8, generator=g) for _ in range(3)]
    text = [torch.randn(1, 2, 3, 8, generator=g) for _ in range(3)]
    q, k, v = (take_shard(t, 2, 2, mesh.group_rank("sp")) for t in image)
    with _HostSyncs() as syncs:
        out, joint_out = sp_attention(q, k, v, mesh, joint_q=text[0], joint_k=text[1], joint_v=text[2], seq_len=seq_len)
    full = F.scaled_dot_product_attention(*(torch.cat([i, t], dim=2) for i, t in zip(image, text)))
    error = max(
        (out - take_shard(full[:, :, :seq_len], 2, 2, mesh.group_rank("sp"))).abs().max().item(),
        (joint_out - full[:, :, seq_len:]).abs().max().item(),
    )
    return syncs.seen, error


def test_ring_with_text_reads_nothing_back_to_the_host():
    """Before: `if torch.isfinite(lse).any()` per gathered block, a device-to-host sync per ring step."""
    for syncs, error in run_on_ranks(_ring_host_syncs, 2, 16):
        assert syncs == [], syncs
        assert error < 1e-5


# ---- process groups: the world's timeout, destroyed when replaced ---------------------------------------


def _group_timeout():
    """Rank 1 never joins rank 0's all-reduce on their ulysses group; it stays alive, as a stuck rank does."""
    mesh = RankMesh(ParallelConfig(ulysses=2))
    if mesh.rank == 1:
        time.sleep(15)
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4), mesh, "ulysses")
    except Exception as error:  # torch's DistBackendError / RuntimeError
        return dict(seconds=time.monotonic() - start, error=type(error).__name__)
    return dict(seconds=time.monotonic() - start, error=None)


def test_mesh_groups_take_the_worlds_timeout():
    """Before: new_group(timeout=None), torch's default of 30 minutes for gloo (10 for NCCL)."""
    result = run_on_ranks(_group_timeout, 2, timeout_s=60, collective_timeout_s=3)[0]
    assert result["error"] is not None and result["seconds"] < 12, result


def _groups_closed(folder):
    from torch.distributed.distributed_c10d import _world

    from xdit_lab.pipeline import load_pipeline
    from xdit_lab.plan import MemoryPlanError

    counts = dict(start=len(_world.pg_map))
    mesh = RankMesh(ParallelConfig(cfg=2))
    counts["built"] = len(_world.pg_map)
    mesh.close()
    mesh.close()  # twice is fine
    counts["closed"] = len(_world.pg_map)
    try:
        comm.all_gather(torch.ones(1), mesh, "cfg", dim=0)
        used = None
    except RuntimeError as error:
        used = str(error)
    for config in (ParallelConfig(cfg=2), ParallelConfig(ulysses=2), ParallelConfig(ring=2)):
        pipe = load_pipeline(folder, config, progress=False)
        # the groups of this configuration and no more: cfg2 makes cfg and world; ulysses2 ulysses, sp, world
        groups = sum(pipe.mesh.group_size(name) > 1 for name in GROUP_NAMES)
        counts.setdefault("loaded", []).append(len(_world.pg_map) - counts["start"] - groups)
        pipe.close()
    counts["pipelines_closed"] = len(_world.pg_map)
    try:
        load_pipeline(folder, ParallelConfig(cfg=2), memory_limit_bytes=1, progress=False)
    except MemoryPlanError:
        counts["after_failed_load"] = len(_world.pg_map)
    last = RankMesh(ParallelConfig(cfg=2))
    dist.destroy_process_group()  # the world goes first: closing afterwards is a no-op, not an error
    last.close()
    return counts, used


def test_meshes_and_pipelines_destroy_their_groups(tmp_path):
    """Before: every load made communicators (GPU memory on NCCL) that lived until the process ended."""
    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    for counts, used in run_on_ranks(_groups_closed, 2, folder, timeout_s=180):
        assert counts["built"] > counts["start"]
        assert counts["closed"] == counts["start"], counts
        assert counts["pipelines_closed"] == counts["start"] == counts["after_failed_load"], counts
        assert counts["loaded"] == [0, 0, 0], counts  # none left from the loads before
        assert used and "was closed" in used


# ---- models are freed when replaced, without waiting for a garbage collection -------------------------


def _freed_without_gc(family, config):
    import weakref

    model = parallelize(tiny_transformer(family, seed=0), config, RankMesh(config))
    with torch.no_grad():
        model(**tiny_inputs(family, 2))
    watched = weakref.ref(model)
    gc.disable()  # only reference counting: a cycle would keep it
    try:
        del model
        return watched() is None
    finally:
        gc.enable()


@pytest.mark.parametrize(
    "family,config",
    [
        ("pixart", ParallelConfig(ulysses=2)),
        ("flux", ParallelConfig(cfg=2)),
        ("pixart", ParallelConfig(pipefusion=2)),
        ("dit", ParallelConfig(pipefusion=2)),
    ],
    ids=["ulysses", "cfg", "pf", "dit-pf"],
)
def test_a_parallelized_model_is_freed_by_its_last_reference(family, config):
    """Before: transformer.forward's closure held the bound forward, a cycle through the model."""
    assert run_on_ranks(_freed_without_gc, 2, family, config, timeout_s=120) == [True, True]


def test_lab_configure_frees_the_old_model_and_its_groups(tmp_path, monkeypatch):
    from xdit_lab.lab import Lab, engine

    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    folder = save_tiny_pipeline("pixart", tmp_path / "pixart")
    with Lab(n=2, backend="gloo", timeout_s=90, collective_timeout_s=30) as lab:
        configs = [ParallelConfig(cfg=2), ParallelConfig(ulysses=2), ParallelConfig(cfg=2), ParallelConfig(ring=2)]
        lab.load(folder, configs[0], progress=False)
        lab.call(gc.disable, state=False)  # no collection by chance: what frees the old model is the reload
        groups = [lab.call(engine.memory)[0]["process_groups"]]
        for config in configs[1:]:
            assert lab.call(engine.watch_transformer) == {0: True, 1: True}
            lab.configure(config)
            assert lab.call(engine.watched_alive) == {0: False, 1: False}, config
            groups.append(lab.call(engine.memory)[0]["process_groups"])
        session = lab.session("a red cat", **dict(tiny_pipeline_kwargs("pixart"), num_inference_steps=2), seed=0)
        assert session.run().result(output_type="latent").images.shape[0] == 1
    # the world's group and this configuration's, no more (before: every configure added its groups)
    expected = [
        1 + sum(RankMesh(c, rank=0, world_size=2).group_size(name) > 1 for name in GROUP_NAMES) for c in configs
    ]
    assert groups == expected


# ---- PipeFusion: message order, index tensors, dtypes ----------------------------------------------------


def _pipefusion_order(stages, steps):
    from xdit_lab import sharding as pf_module

    posted, built = [], []
    exchange = comm.exchange

    def spy_exchange(sends, recvs, mesh, group, *, tag=""):  # calls through; remembers the order of posting
        posted.extend(["send"] * len(sends) + ["recv"] * len(recvs))
        return exchange(sends, recvs, mesh, group, tag=tag)

    rank_tokens = pf_module.PatchLayout.rank_tokens

    def spy_rank_tokens(self, active, sp_rank):
        built.append(tuple(active))
        return rank_tokens(self, active, sp_rank)

    comm.exchange, pf_module.PatchLayout.rank_tokens = spy_exchange, spy_rank_tokens
    try:
        config = ParallelConfig(pipefusion=stages, num_patches=4)
        model = parallelize(tiny_transformer("pixart", seed=0, layers=stages), config, RankMesh(config))
        inputs = tiny_inputs("pixart", 2)
        builds = []
        with torch.no_grad():
            for _ in range(steps):
                outputs = model(**inputs).sample
                builds.append(len(built))
    finally:
        comm.exchange, pf_module.PatchLayout.rank_tokens = exchange, rank_tokens
    return dict(posted=posted, builds=builds, finite=bool(outputs.isfinite().all()))


def test_pipefusion_middle_stage_sends_are_not_queued_behind_its_receives():
    """On NCCL a group's point-to-point ops run in posting order on one stream. Before: the middle
    stage posted all of a step's receives first, so patch 0 left only after the last patch arrived."""
    per_rank = run_on_ranks(_pipefusion_order, 3, 3, 3, timeout_s=240)
    middle = per_rank[1]["posted"]
    assert middle.count("send") == middle.count("recv") == 1 + 4 * 2  # warmup step, then 4 patches × 2 steps
    for i, where in enumerate(j for j, op in enumerate(middle) if op == "send"):
        # before send i: this step's receives up to patch i+1 only (one ahead)
        assert middle[:where].count("recv") <= i + 2, middle
    assert all(r["finite"] for r in per_rank)
    # token index tensors are made once per layout (warmup's whole image, then each patch), not per step
    for r in per_rank:
        assert r["builds"][1] == r["builds"][2], r["builds"]


def _pipefusion_under_autocast():
    config = ParallelConfig(pipefusion=2, num_patches=2)
    inputs = tiny_inputs("pixart", 2)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = tiny_transformer("pixart", seed=0)(**inputs).sample  # autocast's bfloat16
        model = parallelize(tiny_transformer("pixart", seed=0), config, RankMesh(config))
        output = model(**inputs).sample  # the first call is warmup: the whole image at once, exact
    return str(output.dtype), ((output.float() - reference.float()).norm() / reference.float().norm()).item()


def test_pipefusion_messages_keep_the_models_dtype_under_autocast():
    """Before: stage 0 received the noise into a float32 buffer (the latents' dtype) while the last
    stage broadcast autocast's bfloat16; gloo filled it with the wrong bytes: relative error 1.25 on
    stage 0, silently (NCCL would have hung on the size mismatch)."""
    for dtype, error in run_on_ranks(_pipefusion_under_autocast, 2, timeout_s=120):
        assert dtype == "torch.float32"  # the model's dtype, on every stage
        assert error < 1e-6


# ---- the Lab on a GPU host, and what `make setup` installed -----------------------------------------------


def test_engine_count_rule():
    from xdit_lab.lab.processes import engine_plan

    assert engine_plan(2, 0, None, 8)[0] == 2  # no GPU: CPU engines
    assert engine_plan(None, 0, None, 3)[0] == 3  # one per core by default
    assert engine_plan(None, 4, None, 8) == (4, {})  # one per GPU, GPUs visible
    assert engine_plan(2, 4, "nccl", 8) == (2, {})
    n, env = engine_plan(4, 1, "gloo", 2)  # CPU engines on a GPU host: any number, GPUs hidden from them
    assert n == 4 and env["CUDA_VISIBLE_DEVICES"] == "" and env["OMP_NUM_THREADS"] == "1"
    with pytest.raises(ValueError, match=r"4 engines but 1 visible GPUs.*Lab\(n=4, backend='gloo'\)"):
        engine_plan(4, 1, None, 2)
    assert engine_plan(2, 0, None, 8, {"X": "1"})[1]["X"] == "1"


def test_env_report_names_torch_and_whether_cuda_is_usable():
    done = subprocess.run(
        [sys.executable, "-m", "xdit_lab.env"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"torch {torch.__version__}" in done.stdout
    assert "CUDA usable: no" in done.stdout  # this machine has no GPU
