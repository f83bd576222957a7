"""The explorer: pick a parallel configuration, step a generation, watch what each rank holds.

    lab.load("digits", ParallelConfig(cfg=2))
    Explorer(lab)                       # the widget panel (explorer_widgets.py)
    ExplorerController(lab).step()      # the same without a browser: a Frame of figures

Two layers. `ExplorerController` is plain Python (state + step/run/reset/apply_config, each
returning a `Frame`: a status line, the figures to show, or the error text), so it is tested
without a browser. `Explorer` (explorer_widgets.py) only lays ipywidgets over it.

What is valid comes from `ParallelConfig.options` and `ParallelConfig.problems` with the model's
own sizes (heads, layers, image tokens), read from the loaded pipeline on rank 0, and whether tp can split it
(its family's tp plan, the load's options): tp is picked like any other degree. A configuration
may use fewer ranks than the Lab has (the others stay idle), so the options cover 1..n ranks.

The engine-side helpers below (`model_shape`, `preview`) run on the engines like lab/engine.py's:
ipyparallel sends them by reference to this module, so importing it must stay cheap (no widgets).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field

from ..config import GRID, SCHEDULES, ParallelConfig
from .errors import LabError
from .planning import ModelShape, explain, plan, valid_configs

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in ipyparallel's remote tracebacks
PICKERS = (*GRID, "num_patches", "warmup_steps", "pipefusion_schedule")  # the ParallelConfig knobs offered


# ---- on the engines ---------------------------------------------------------------------------------


def model_shape(state: dict, session_kwargs: dict) -> dict:
    """The sizes the rules need, from the pipeline this engine holds (rank 0 is always active), and
    whether the explorer's calls have two branches, as the family's recipe decides (a true-CFG family,
    families.recipe.TrueCFGRecipe, has two only with a negative prompt)."""
    import json

    import diffusers

    from ..config import ParallelConfigError
    from ..families.tp_plan import model_plan
    from ..models import parallel_state

    pipe = state.get("pipe")
    if pipe is None or not pipe.active:
        raise RuntimeError("no pipeline is loaded on this engine: call lab.load(...) first")
    inner, defaults = pipe.diffusers_pipeline, pipe.call_defaults
    multiple, default = pipe.recipe.size_multiple(inner)
    height = session_kwargs.get("height") or defaults.get("height") or default[0]
    width = session_kwargs.get("width") or defaults.get("width") or default[1]
    # the folder's config, not the module's: a PipeFusion stage may hold only its own blocks
    config = json.loads((pipe.folder / "transformer" / "config.json").read_text())
    adapter = parallel_state(inner.transformer).adapter
    tp_refused = None
    try:  # tp where the family has a plan (diffusers' _tp_plan or the adapter's), as load_pipeline asks it
        model_plan(getattr(diffusers, config["_class_name"]), adapter)
    except ParallelConfigError as error:
        tp_refused = str(error)
    heads, head_dim = adapter.attention_shape(config)  # as the family's config spells them (Z-Image: n_heads, dim)
    return dict(
        family=adapter.family,
        num_heads=heads,
        num_layers=adapter.num_blocks(config),  # every block list PipeFusion cuts (Flux: double and single)
        hidden_size=heads * head_dim if isinstance(head_dim, int) else None,
        rows=height // multiple,
        cols=width // multiple,
        # whether a call has two branches depends on its options, not its text: an empty prompt (one token)
        # stands in, so that no token budget (max_sequence_length) can refuse it
        use_cfg=pipe.recipe.do_cfg(pipe.request("", **session_kwargs)),
        cfg_needs=pipe.recipe.cfg_needs,
        tp_refused=tp_refused,
        num_inference_steps=defaults["num_inference_steps"],
    )


def preview(state: dict, limit: int):
    """The current latents decoded by this rank's VAE, as float images [N, H, W, 3] in [0, 1].
    Called on rank 0 alone, so the VAE decodes whole here (vae.decoding_whole): no peer has to join in."""
    import numpy as np
    import torch

    session = state.get("session")
    if session is None:
        return None
    from xdit_lab.vae import decoding_whole

    inner = session.pipe.diffusers_pipeline
    with torch.no_grad(), decoding_whole(inner.vae):
        images = session.recipe.decode(inner, session.prepared, session.latents[:limit], "np")
    return np.asarray(images, dtype=np.float32)


def serial_deviation(state: dict) -> dict | None:
    """(rank 0) How far this engine's session is from the serial run at the same step: max |a - b| / max |b|
    of the latents (lab/measure.py). The serial run is this package on one rank (a world of one: no peer
    joins in; equal to diffusers' pipeline, tests/test_pipelines.py), loaded once beside the Lab's pipeline
    in its dtype, without its step cache or compile, and stepped with the same request.
    None before a step; 0.0 under the serial configuration, which is the reference itself."""
    from xdit_lab.config import ParallelConfig
    from xdit_lab.mesh import RankMesh
    from xdit_lab.pipeline import load_pipeline

    from .measure import compare_to_serial

    session = state.get("session")
    if session is None or session.step_index == 0:
        return None
    if session.pipe.config.world_size == 1:
        return dict(max_relative=0.0, relative_l2=0.0)
    request, dtype = session.request, session.pipe.diffusers_pipeline.transformer.dtype
    if request.seed is None:
        raise RuntimeError("the serial reference needs the session's seed (seed=N), not a generator it consumed")
    reference = state.get("serial_reference")
    if reference is None or reference["key"] != (str(session.pipe.folder), dtype):
        state["serial_reference"] = reference = None  # the old one is freed before the next loads
        serial = ParallelConfig()
        pipe = load_pipeline(
            session.pipe.folder, serial, mesh=RankMesh(serial, rank=0, world_size=1), torch_dtype=dtype, progress=False
        )
        state["serial_reference"] = reference = dict(key=(str(session.pipe.folder), dtype), pipe=pipe, session=None)
    serial_session = reference["session"]
    if serial_session is None or serial_session.request != request or serial_session.step_index > session.step_index:
        r = request
        serial_session = reference["session"] = reference["pipe"].session(
            r.prompts, r.negatives, r.num_inference_steps, r.guidance_scale, r.height, r.width, seed=r.seed, **r.options
        )
    while serial_session.step_index < session.step_index:
        serial_session.step()
    return compare_to_serial(session.latents, serial_session.latents)


# ---- the controller -----------------------------------------------------------------------------------


@dataclass
class Frame:
    """What the panel shows after an action: a status line, figures by name, or an error."""

    status: str
    figures: dict = field(default_factory=dict)  # name -> matplotlib Figure, in display order
    error: str | None = None
    details: str = ""  # the remote tracebacks of a LabError, for whoever opens them


class ExplorerController:
    """State and actions of the explorer, without widgets.

    `session_kwargs` are extra call arguments for `lab.session(...)`; what they leave out is the
    loaded pipeline's own default (`pipe.call_defaults`: the model folder's, then the family's).
    `prompt` may hold several prompts separated by ';'."""

    def __init__(
        self,
        lab,
        *,
        prompt: str | None = None,
        steps: int | None = None,
        seed: int = 0,
        session_kwargs: dict | None = None,
        preview_limit: int = 4,
        timeout_s: float | None = None,
        compare_serial: bool = True,
    ):
        if lab.loaded is None:
            raise LabError("nothing is loaded yet: call lab.load(name_or_path, config) before the explorer")
        self.lab, self.seed, self.preview_limit, self.timeout_s = lab, seed, preview_limit, timeout_s
        self.compare_serial = compare_serial  # measure each step against the serial run (serial_deviation)
        self.history: list[dict] = []  # one row per step of the session: step, seconds, deviation, bytes
        self.deviation_problem = ""  # why the deviation could not be measured, when it could not
        self.session_kwargs = dict(session_kwargs or {})
        default_steps = self.session_kwargs.pop("num_inference_steps", None)
        self.prompt = prompt or ("a handwritten 7" if lab.loaded.name_or_path == "digits" else "a red cat")
        self.session, self.session_seed = None, None
        answer = lab.call(model_shape, self.session_kwargs, ranks=[0], what="explorer.model_shape")[0]
        recipe_steps = answer.pop("num_inference_steps")
        options = lab.loaded.options  # what tp is not composed with yet is refused with the load's own options
        answer["load_options"] = dict(quantization=options.quantization)  # tp_plan.option_refusals' arguments
        self.steps, self.shape = steps or default_steps or recipe_steps, ModelShape(**answer)

    # ---- what is valid ----------------------------------------------------------------------------
    @property
    def engines(self) -> int:
        return self.lab.world_size

    @property
    def config(self) -> ParallelConfig:
        return self.lab.config

    def options(self) -> list[ParallelConfig]:
        return valid_configs(self.engines, self.shape)

    def choices(self) -> dict[str, list]:
        """The values each picker offers: those some valid configuration uses (num_patches: None
        is one per stage; warmup: 0 up to the steps, at most 4; PipeFusion's two schedules)."""
        options = self.options()
        found = {name: sorted({getattr(c, name) for c in options}) for name in GRID}
        found["num_patches"] = [None, *range(1, self.shape.rows + 1)]
        found["warmup_steps"] = list(range(0, min(self.steps, 4) + 1))
        found["pipefusion_schedule"] = list(SCHEDULES)
        return found

    def explain(self, config: ParallelConfig) -> list[str]:
        return explain(config, self.engines, self.shape)

    def plan(self, gpus: int) -> str:
        """Planning mode, for GPUs this Lab does not have: every configuration for `gpus` ranks with
        this model and the current prompts, ranked by the cost model with the reasons (planning.py)."""
        return plan(gpus, self.shape, batch=len(self.prompts()))

    def plan_folder(self, folder: str, gpus: int, gpu_memory):
        """Planning mode for a model folder on `gpus` GPUs of `gpu_memory` ('24GB' or bytes): plan_model's
        rows, best first (lab/folder_planning.py); ValueError says what is wrong. A blank folder plans the
        loaded model in the dtype it was loaded in, with its quantization when it is a named scheme, for the
        explorer's own request (its prompts, size and call options); another folder at that model's defaults,
        in bfloat16 (plan_model's default)."""
        from ..model_folder import resolve_folder
        from ..pipeline import resolve_dtype
        from .folder_planning import plan_folder

        if str(folder).strip():
            return plan_folder(folder, gpus, gpu_memory)
        options = dict(self.session_kwargs)
        size = dict(height=options.pop("height", None), width=options.pop("width", None))
        loaded = self.lab.loaded
        device = self.lab.ranks[0].get("device", "cpu") if self.lab.ranks else "cpu"  # load_pipeline's "auto"
        dtype = resolve_dtype(loaded.options.torch_dtype, device)
        folder = resolve_folder(loaded.name_or_path)
        scheme = loaded.options.quantization
        quantize = scheme if isinstance(scheme, str) else None  # a diffusers config: planned unquantized
        return plan_folder(
            folder, gpus, gpu_memory, batch=len(self.prompts()), options=options, dtype=dtype, quantize=quantize, **size
        )

    def prompts(self) -> list[str]:
        return [p.strip() for p in self.prompt.split(";") if p.strip()] or [""]

    # ---- actions: each returns the Frame to show ---------------------------------------------------
    def apply_config(self, config: ParallelConfig | None = None, **degrees) -> Frame:
        """Load the pipeline under `config` (or the current one with `degrees` changed) and start
        a new session; an invalid configuration changes nothing and says why."""
        config = (config or self.config).replace(**degrees)
        problems = self.explain(config)
        if problems:
            return self._frame(error=f"{config.short()} cannot run here:\n" + "\n".join(f"  - {p}" for p in problems))

        def load_and_start():
            self.lab.configure(config, timeout_s=self.timeout_s)
            return self.reset()

        return self._guard(load_and_start)

    def set_request(self, *, prompt: str | None = None, steps: int | None = None, seed: int | None = None) -> None:
        """Prompt, steps and seed for the next reset() (the running session keeps its own)."""
        self.prompt = self.prompt if prompt is None else prompt
        self.steps = self.steps if steps is None else int(steps)
        self.seed = self.seed if seed is None else int(seed)

    def reset(self) -> Frame:
        """A new session with the current prompt, steps and seed (nothing run yet)."""

        def start():
            prompts = self.prompts()
            self.session, self.history, self.deviation_problem = None, [], ""  # a failed start leaves none
            self.session = self.lab.session(
                prompts, seed=self.seed, num_inference_steps=self.steps, timeout_s=self.timeout_s, **self.session_kwargs
            )
            self.session_seed = self.seed  # set_request may change self.seed before the next reset
            return self.refresh()

        return self._guard(start)

    def step(self) -> Frame:
        return self._advance(1)

    def run(self) -> Frame:
        return self._advance(None)

    def _advance(self, steps: int | None) -> Frame:
        """`steps` steps (None: the rest), one at a time, so each gets its row in the history."""
        if self.session is None or self.session.token != self.lab.session_token:
            frame = self.reset()  # none yet, or the Lab moved on (a load or a session from a cell)
            if frame.error:
                return frame
        if self.session.done:
            return self._frame(error=f"all {self.session.num_steps} steps are done: Reset starts a new generation")

        def advance():
            for _ in range(self.session.num_steps - self.session.step_index if steps is None else steps):
                start = time.perf_counter()
                self.session.step(timeout_s=self.timeout_s)
                self.history.append(
                    dict(step=self.session.step_index, seconds=time.perf_counter() - start, deviation=self._deviation())
                )
            return self.refresh()

        return self._guard(advance)

    def _deviation(self) -> float | None:
        """The session's max relative deviation from the serial run now; None when not measured (why:
        self.deviation_problem; the serial model may not fit beside the Lab's, for example)."""
        if not self.compare_serial or self.deviation_problem:
            return None
        try:
            answer = self.lab.call(
                serial_deviation, ranks=[0], timeout_s=self.timeout_s, what="explorer.serial_deviation"
            )[0]
        except LabError as error:
            self.deviation_problem = str(error).splitlines()[0]
            return None
        return None if answer is None else answer["max_relative"]

    # ---- what to show ------------------------------------------------------------------------------
    def refresh(self) -> Frame:
        """The views of the session as it stands: shards, staleness (PipeFusion), memory, comm, the last
        step's timeline (after a step), latent."""
        from .stale_views import draw_staleness
        from .views import draw_comm, draw_latent, draw_memory, draw_shards

        summaries = self.session.summaries(timeout_s=self.timeout_s)
        for row in self.history:  # bytes out of the busiest rank in each step, as comm_log measured them
            row["bytes"] = max(
                (sum(s["comm"]["measured"][row["step"] - 1].values()) for s in summaries if s is not None), default=0
            )
        figures = {"shards": draw_shards(summaries)}
        if self.config.pipefusion > 1:
            figures["staleness"] = draw_staleness(summaries)
        figures["memory"] = draw_memory(summaries)
        figures["comm"] = draw_comm(summaries)
        if self.session.step_index > 0:
            figures["timeline"] = self.session.timeline(timeout_s=self.timeout_s)
        if self.history:
            figures["history"] = draw_history(self.history)
        images = self.lab.call(
            preview, self.preview_limit, ranks=[0], timeout_s=self.timeout_s, what="explorer.preview"
        )[0]
        if images is not None:
            import numpy as np

            # the batch side by side, one pixel column of white between images
            gap = np.ones((images.shape[1], 1, 3), dtype=images.dtype)
            strip = np.concatenate([part for image in images for part in (image, gap)][:-1], axis=1)
            figures["latent"] = draw_latent(strip, self.session.step_index, title="decoded on rank 0")
        return self._frame(figures=figures)

    def status(self) -> str:
        config = f"{self.config.short()} on {self.config.world_size} of {self.engines} ranks"
        if self.session is None:
            return f"{config}; no session yet"
        s = self.session
        where = "done" if s.done else f"next timestep {float(s.timestep):g}"
        text = f"{config}; step {s.step_index} of {s.num_steps} ({where}); seed {self.session_seed}"
        deviation = self.history[-1]["deviation"] if self.history else None
        if deviation is not None:  # under 1e-5 the digits are float32 rounding, which varies by machine
            from .measure import deviation_text

            text += f"; from serial {deviation_text(deviation)}"
        elif self.deviation_problem:
            text += f"; no serial reference: {self.deviation_problem}"
        return text

    def _frame(self, figures=None, error=None, details="") -> Frame:
        return Frame(status=self.status(), figures=figures or {}, error=error, details=details)

    def _guard(self, action) -> Frame:
        """Run an action; the errors a user can cause become the frame's error text, not a lost traceback."""
        try:
            return action()
        except LabError as error:
            # the panel has no `error` object to call .tracebacks() on: the frame carries them
            message = str(error).replace("\nThe remote tracebacks: error.tracebacks().", "")
            return self._frame(error=message, details=ANSI.sub("", error.tracebacks()) if error.failures else "")
        except (ValueError, RuntimeError) as error:  # refused here, before any engine was called
            return self._frame(error=f"{type(error).__name__}: {error}")


def draw_history(rows: list[dict]):
    """The session's steps so far: the deviation from serial (log scale, beside the 1e-4 that the exact
    strategies keep), the wall time of each step as the notebook saw it, and the bytes out of the busiest rank."""
    from .views import new_figure

    fig = new_figure(figsize=(7.5, 2.8))
    deviation, seconds = fig.subplots(1, 2)
    steps = [row["step"] for row in rows]
    measured = [(row["step"], max(row["deviation"], 1e-12)) for row in rows if row["deviation"] is not None]
    if measured:
        deviation.semilogy(*zip(*measured), "o-", color="C3")
    deviation.axhline(1e-4, color="grey", linestyle="--", linewidth=1, label="1e-4: exact")
    deviation.set(xlabel="step", ylabel="max relative", title="deviation from serial")
    deviation.legend(loc="lower right")
    seconds.bar(steps, [1e3 * row["seconds"] for row in rows], color="C0")
    seconds.set(xlabel="step", ylabel="ms", title="step wall time")
    traffic = [row.get("bytes", 0) / 1000 for row in rows]
    if any(traffic):
        twin = seconds.twinx()
        twin.plot(steps, traffic, "s-", color="C1")
        twin.set_ylim(0, 1.2 * max(traffic))
        twin.set_ylabel("KB out, busiest rank", color="C1")
    for axes in (deviation, seconds):
        axes.xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    return fig


def current_choice(config: ParallelConfig) -> dict:
    """A config's picker values, by picker name."""
    return {name: getattr(config, name) for name in PICKERS}


def config_from(choice: dict) -> ParallelConfig:
    return ParallelConfig(**{name: choice[name] for name in PICKERS})


__all__ = [
    "ExplorerController",
    "Frame",
    "ModelShape",
    "valid_configs",
    "explain",
    "plan",
    "config_from",
    "current_choice",
]
