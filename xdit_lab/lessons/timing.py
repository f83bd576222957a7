"""Honest timings (tutorial 09): warm-up runs apart, phases apart, medians over runs.

    vae_decoder_calls(state)            (engine) how often the VAE's decoder ran on this rank
    timed_lab_runs(lab, prompts, ...)   warm-up runs, then timed runs of a Lab session
    phase_medians(timings)              the median of every phase over runs

The times are the session's own PhaseTimings; this only runs and reduces them.
"""

from __future__ import annotations

import statistics
import time


def vae_decoder_calls(state: dict) -> int | None:
    """(engine) How many times the VAE's decoder has run on this rank since this pipeline was loaded
    (a counting hook is added on first use; idle ranks answer None)."""
    pipe = state.get("pipe")
    if pipe is None or not pipe.active:
        return None
    decoder = pipe.diffusers_pipeline.vae.decoder
    if not hasattr(decoder, "_xdit_lab_calls"):
        decoder._xdit_lab_calls = 0

        def count(module, args):
            module._xdit_lab_calls += 1

        decoder.register_forward_pre_hook(count)
    return decoder._xdit_lab_calls


def timed_lab_runs(
    lab, prompts, *, runs: int, warmup: int = 1, seed: int = 0, output_type: str = "latent", **call_kwargs
) -> dict:
    """`warmup` untimed runs, then `runs` timed runs of lab.session(...).run().result(output_type):
    rank 0's PhaseTimings of each, and the wall-clock seconds the notebook waited for each."""

    def one():
        start = time.perf_counter()
        output = lab.session(prompts, seed=seed, **call_kwargs).run().result(output_type=output_type)
        return output.timings, time.perf_counter() - start

    warm = [one() for _ in range(warmup)]
    timed = [one() for _ in range(runs)]
    return dict(
        warmup=[t for t, _ in warm],
        warmup_wall=[w for _, w in warm],
        runs=[t for t, _ in timed],
        wall=[w for _, w in timed],
    )


def phase_medians(timings: list[dict]) -> dict:
    """The median over runs of every phase (encode, prepare, denoise, decode) and of a step."""
    if not timings:
        raise ValueError("no timed runs to take a median of")
    phases = {name: statistics.median(t[name] for t in timings) for name in ("encode", "prepare", "denoise", "decode")}
    phases["step"] = statistics.median(s for t in timings for s in t["steps"])
    return phases
