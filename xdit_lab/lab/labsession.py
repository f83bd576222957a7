"""LabSession: a DenoiseSession seen from the notebook; every call drives all engines' sessions.

It mirrors DenoiseSession (step, run, result, step_index, timestep, done, latents, cache_skips), so a cell
written against a local pipeline reads the same against a Lab. The engines hold the real
sessions; this object holds where rank 0 says they stand, refreshed by every call.
"""

from __future__ import annotations

from . import engine
from .errors import LabError


class LabSession:
    def __init__(self, lab, token: int, progress: dict):
        self.lab, self.token = lab, token
        self._progress = progress

    def _call(self, fn, *args, what: str, timeout_s=None, **kwargs) -> dict:
        if self.lab.session_token != self.token:
            raise LabError(
                f"session.{what}: this session's engines have moved on (a newer lab.session(), "
                f"lab.load(), lab.configure() or lab.restart()); start a new one with lab.session(...)"
            )
        return self.lab.call(fn, *args, timeout_s=timeout_s, what=f"session.{what}", **kwargs)

    # ---- the loop ---------------------------------------------------------------------------------
    def step(self, *, timeout_s: float | None = None) -> LabSession:
        """Exactly one scheduler step, on every engine."""
        self._progress = self._call(engine.step, what="step", timeout_s=timeout_s)[0]
        return self

    def run(self, *, timeout_s: float | None = None) -> LabSession:
        """The remaining steps, in one call to the engines (give a long model a longer timeout_s)."""
        self._progress = self._call(engine.run, what="run", timeout_s=timeout_s)[0]
        return self

    def result(self, output_type: str = "pil", return_dict: bool = True, *, timeout_s: float | None = None):
        """DenoiseSession.result on every active engine; rank 0's output (the same on all of them)."""
        answer = self._call(engine.result, output_type, return_dict, what="result", timeout_s=timeout_s)[0]
        if not return_dict:
            return answer
        output = answer["output_class"](**answer["fields"])
        output.timings, output.comm_per_step = answer["timings"], answer["comm_per_step"]
        output.cache_skips = answer["cache_skips"]
        return output

    def summaries(self, *, timeout_s: float | None = None) -> list[dict]:
        """xdit_lab.lab.summaries.rank_summary(session) of every active rank, in rank order."""
        answers = self._call(engine.summaries, what="summaries", timeout_s=timeout_s)
        return [answers[rank] for rank in sorted(answers) if answers[rank] is not None]

    def timings(self, *, timeout_s: float | None = None) -> dict:
        """{rank: its PhaseTimings so far, as a dict of seconds}, idle ranks left out."""
        answers = self._call(engine.timings, what="timings", timeout_s=timeout_s)
        return {rank: answer for rank, answer in answers.items() if answer is not None}

    def timeline(self, *, save_trace=None, timeout_s: float | None = None):
        """The last step on every active rank: collectives, transfers in flight, waits and, between
        them, compute (lab/timeline.py). `save_trace="step.json"` also writes it as a Chrome trace
        for ui.perfetto.dev. Returns the figure."""
        from .timeline import draw_timeline
        from .timeline import save_trace as write_trace

        answers = self._call(engine.step_spans, what="timeline", timeout_s=timeout_s)
        per_rank = {rank: spans for rank, spans in answers.items() if spans is not None}
        if not per_rank:
            raise LabError("session.timeline(): no step has run yet in this session; call session.step() first")
        if save_trace is not None:
            write_trace(per_rank, save_trace)
        return draw_timeline(per_rank)

    # ---- state -------------------------------------------------------------------------------------
    @property
    def step_index(self) -> int:
        return self._progress["step_index"]

    @property
    def num_steps(self) -> int:
        return self._progress["num_steps"]

    @property
    def done(self) -> bool:
        return self._progress["done"]

    @property
    def cache_skips(self) -> list[bool]:
        """Per step done, whether the StepCache skipped the blocks after the first (all ranks agree)."""
        return self._progress["cache_skips"]

    @property
    def timestep(self):
        """The timestep the next step() runs at (None when done)."""
        return self._progress["timestep"]

    @property
    def latents(self):
        """The whole current latents, fetched from a rank that holds them: rank 0 (every active rank
        does after a step), or under PipeFusion's async schedule the last stage's first rank (the
        other stages receive a step's latents patch by patch as they run the next one)."""
        config = self.lab.config
        rank = 0
        if config is not None and config.pipefusion_schedule == "async":
            rank = (config.pipefusion - 1) * config.ring * config.ulysses  # ulysses varies fastest (mesh.py)
        return self._call(engine.latents, what="latents", ranks=[rank])[rank]

    def __repr__(self) -> str:
        config = self.lab.config.short() if self.lab.config else "?"
        return f"<LabSession step {self.step_index} of {self.num_steps} under {config} on {self.lab.world_size} ranks>"
