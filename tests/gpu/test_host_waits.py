"""One GPU: a denoising step queues its work and waits for nothing on the host (issue 42).

CUDA's own instrument: `torch.cuda.set_sync_debug_mode("warn")` warns at every synchronizing CUDA call
(a read of a device value, a blocking copy, a stream or device synchronize), including those inside
torch's C++ operators, which tests/test_gpu_schedules.py cannot see on CPU. A world of one on NCCL, the
bundled digits model loaded with the defaults (bfloat16 on CUDA), timeline off: every step after the
first warns 0 times; with a StepCache once (its decision); the control, a NaN check after each step, is
counted. The step's seconds come from CUDA events, read after the steps, and agree with the wall clock
measured with one synchronize at the end."""

import time
import warnings

import torch

GPUS_NEEDED = 1
STEPS = 4


def _syncs_per_step(threshold=None, nan_check=False):
    from xdit_lab import ParallelConfig, load_pipeline
    from xdit_lab.digits import DIGITS_DIR, prompt_for
    from xdit_lab.models import StepCache

    cache = None if threshold is None else StepCache(threshold)
    pipe = load_pipeline(DIGITS_DIR, ParallelConfig(), cache=cache, progress=False)
    session = pipe.session([prompt_for(3), prompt_for(8)], num_inference_steps=STEPS, seed=0)
    session.step()  # the first: kernels chosen, caches warm, the scheduler's step index found
    torch.cuda.synchronize()
    started, per_step = time.perf_counter(), []
    for _ in range(STEPS - 1):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                session.step()
                if nan_check and session.prepared.latents.isnan().any():
                    raise FloatingPointError("NaN in the latents")
            finally:
                torch.cuda.set_sync_debug_mode(0)
        per_step.append([str(w.message)[:120] for w in caught if "synchroniz" in str(w.message)])
    torch.cuda.synchronize()
    wall = time.perf_counter() - started
    seconds = session.timings.as_dict()["steps"]
    return dict(
        syncs=per_step,
        dtype=str(pipe.diffusers_pipeline.transformer.dtype),
        event_seconds=sum(seconds[1:]),
        wall_seconds=wall,
        spans=session.last_step_spans,
    )


def test_a_step_on_cuda_waits_for_nothing(figures):
    from xdit_lab.testing import run_on_ranks

    plain = run_on_ranks(_syncs_per_step, 1, backend="nccl", timeout_s=300)[0]
    cached = run_on_ranks(_syncs_per_step, 1, 0.1, backend="nccl", timeout_s=300)[0]
    control = run_on_ranks(_syncs_per_step, 1, None, True, backend="nccl", timeout_s=300)[0]
    figures(
        syncs_per_step=[len(s) for s in plain["syncs"]],
        with_cache=[len(s) for s in cached["syncs"]],
        control=[len(s) for s in control["syncs"]],
        event_s=plain["event_seconds"],
        wall_s=plain["wall_seconds"],
    )
    assert plain["dtype"] == "torch.bfloat16"  # torch_dtype="auto" on CUDA
    assert plain["spans"] is None  # the timeline is the Lab's, opt-in
    assert plain["syncs"] == [[]] * (STEPS - 1), plain["syncs"]
    assert [len(s) for s in cached["syncs"]] == [1] * (STEPS - 1), cached["syncs"]
    assert all(len(s) >= 1 for s in control["syncs"]), control["syncs"]
    # the events time what the device ran: within the wall clock around the same steps, and most of it
    assert 0.3 * plain["wall_seconds"] <= plain["event_seconds"] <= plain["wall_seconds"] * 1.05, plain
