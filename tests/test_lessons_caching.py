"""Tutorial 12's helpers for diffusers' caches: the per-step table of what each rank did, and diffusers' own serial
run with a cache configuration (the reference the lesson compares the two engines against)."""

import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig

from xdit_lab.lessons.caching import diffusers_serial, steps_by_rank
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

pytestmark = pytest.mark.usefixtures("one_thread")


def _summary(rank, skips, measured):
    return dict(rank=rank, cache=dict(skips=skips), comm=dict(measured=measured))


def test_steps_by_rank_says_where_ranks_disagree_and_what_moved():
    full, skipped = {"ulysses": 300, "world": 8}, {"ulysses": 100, "world": 8}
    summaries = [
        _summary(1, [False, True, True], [{"ulysses": 300}, skipped, full]),
        _summary(0, [False, True, False], [{"ulysses": 300}, skipped, full]),
        None,  # an idle rank
    ]
    lines = steps_by_rank(summaries).splitlines()
    assert lines[0].split()[:4] == ["step", "rank", "0", "rank"], lines[0]  # rank order, whatever the input's
    assert lines[1].split() == ["1", "run", "run", "yes", "0", "/", "0", "300", "/", "300"]
    assert lines[2].split() == ["2", "skip", "skip", "yes", "8", "/", "8", "108", "/", "108"]
    assert lines[3].split()[:4] == ["3", "run", "skip", "NO"]


def test_diffusers_serial_applies_the_cache(tmp_path):
    folder = save_tiny_pipeline("flux", tmp_path)
    call = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=6)
    prompts = ["a red cat", "a blue dog"]
    plain = diffusers_serial(folder, None, prompts, **call)
    off = diffusers_serial(folder, FirstBlockCacheConfig(threshold=0.0), prompts, **call)
    cached = diffusers_serial(folder, FirstBlockCacheConfig(threshold=0.52), prompts, **call)
    assert plain.shape == (2, 16, 64)
    assert torch.allclose(off, plain, atol=1e-6)  # threshold 0: every step runs
    assert (cached - plain).abs().max().item() > 1e-3  # the tiny Flux skips at 0.52 (tests/test_diffusers_cache.py)
