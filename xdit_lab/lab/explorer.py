"""The explorer: pick a parallel configuration, step a generation, watch what each rank holds.

    lab.load("digits", ParallelConfig(cfg=2))
    Explorer(lab)                       # the widget panel (explorer_widgets.py)
    ExplorerController(lab).step()      # the same without a browser: a Frame of figures

Two layers. `ExplorerController` is plain Python (state + step/run/reset/apply_config, each
returning a `Frame`: a status line, the figures to show, or the error text), so it is tested
without a browser. `Explorer` (explorer_widgets.py) only lays ipywidgets over it.

What is valid comes from `ParallelConfig.options` and `ParallelConfig.problems` with the model's
own sizes (heads, layers, image tokens), read from the loaded pipeline on rank 0. A configuration
may use fewer ranks than the Lab has (the others stay idle), so the options cover 1..n ranks.

The engine-side helpers below (`model_shape`, `preview`) run on the engines like lab/engine.py's:
ipyparallel sends them by reference to this module, so importing it must stay cheap (no widgets).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..config import DEGREES, SCHEDULES, ParallelConfig
from .errors import LabError

ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colour codes in ipyparallel's remote tracebacks
PICKERS = (*DEGREES, "num_patches", "warmup_steps", "pipefusion_schedule")  # the ParallelConfig knobs offered


# ---- on the engines ---------------------------------------------------------------------------------


def model_shape(state: dict, height, width) -> dict:
    """The sizes the rules need, from the pipeline this engine holds (rank 0 is always active)."""
    import json

    from ..models import parallel_state

    pipe = state.get("pipe")
    if pipe is None or not pipe.active:
        raise RuntimeError("no pipeline is loaded on this engine: call lab.load(...) first")
    inner, defaults = pipe.diffusers_pipeline, pipe.call_defaults
    multiple, default = pipe.recipe.size_multiple(inner)
    height, width = height or defaults.get("height") or default[0], width or defaults.get("width") or default[1]
    # the folder's config, not the module's: a PipeFusion stage may hold only its own blocks
    config = json.loads((pipe.folder / "transformer" / "config.json").read_text())
    adapter = parallel_state(inner.transformer).adapter
    return dict(
        family=adapter.family,
        num_heads=config["num_attention_heads"],
        num_layers=adapter.num_blocks(config),  # every block list PipeFusion cuts (Flux: double and single)
        rows=height // multiple,
        cols=width // multiple,
        guidance_scale=defaults["guidance_scale"],
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


# ---- the controller -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    family: str
    num_heads: int
    num_layers: int
    rows: int  # image tokens per column, at the call's height
    cols: int
    use_cfg: bool  # guidance > 1: there are two branches for cfg 2 to split

    @property
    def seq_len(self) -> int:
        return self.rows * self.cols


def valid_configs(engines: int, shape: ModelShape, *, num_patches=None, warmup_steps=1) -> list[ParallelConfig]:
    """Every configuration that runs on `engines` ranks or fewer (the rest idle): all ranks first,
    each world size best first by the cost model."""
    found = []
    for world in range(engines, 0, -1):
        found += [
            c
            for c in ParallelConfig.options(
                world,
                num_heads=shape.num_heads,
                num_layers=shape.num_layers,
                seq_len=shape.seq_len,
                use_cfg=shape.use_cfg,
                num_patches=num_patches,
                warmup_steps=warmup_steps,
            )
            if not _extra_problems(c, shape)
        ]
    return found


def explain(config: ParallelConfig, engines: int, shape: ModelShape) -> list[str]:
    """Why `config` cannot run on this Lab and model (empty when it can)."""
    # A smaller world is fine (idle ranks); only a larger one is a mismatch worth the long advice.
    world = engines if config.world_size > engines else None
    found = config.problems(
        world, num_heads=shape.num_heads, num_layers=shape.num_layers, seq_len=shape.seq_len, available_devices=engines
    )
    if world is not None:
        found.append(f"this Lab has {engines} engines: start Lab(n={config.world_size}) for this configuration")
    return found + _extra_problems(config, shape)


def _extra_problems(config: ParallelConfig, shape: ModelShape) -> list[str]:
    """Rules that depend on the model and the call, which ParallelConfig alone cannot know."""
    found = []
    if config.cfg == 2 and not shape.use_cfg:
        found.append(
            "cfg 2 splits the unconditional and conditional branches, but guidance_scale <= 1 runs "
            "only one; use cfg 1 or a guidance scale above 1"
        )
    if config.pipefusion > 1 and config.patches > shape.rows:
        found.append(f"{config.patches} PipeFusion patches are row bands, but the image has {shape.rows} token rows")
    return found


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
    ):
        if lab.loaded is None:
            raise LabError("nothing is loaded yet: call lab.load(name_or_path, config) before the explorer")
        self.lab, self.seed, self.preview_limit, self.timeout_s = lab, seed, preview_limit, timeout_s
        self.session_kwargs = dict(session_kwargs or {})
        default_steps = self.session_kwargs.pop("num_inference_steps", None)
        self.prompt = prompt or ("a handwritten 7" if lab.loaded.name_or_path == "digits" else "a red cat")
        self.session, self.session_seed = None, None
        answer = lab.call(
            model_shape,
            self.session_kwargs.get("height"),
            self.session_kwargs.get("width"),
            ranks=[0],
            what="explorer.model_shape",
        )[0]
        recipe_steps, recipe_guidance = answer.pop("num_inference_steps"), answer.pop("guidance_scale")
        self.steps = steps or default_steps or recipe_steps
        self.shape = ModelShape(**answer, use_cfg=self.session_kwargs.get("guidance_scale", recipe_guidance) > 1)

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
        found = {name: sorted({getattr(c, name) for c in options}) for name in DEGREES}
        found["num_patches"] = [None, *range(1, self.shape.rows + 1)]
        found["warmup_steps"] = list(range(0, min(self.steps, 4) + 1))
        found["pipefusion_schedule"] = list(SCHEDULES)
        return found

    def explain(self, config: ParallelConfig) -> list[str]:
        return explain(config, self.engines, self.shape)

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
            prompts = [p.strip() for p in self.prompt.split(";") if p.strip()] or [""]
            self.session = None  # a failed start leaves none behind
            self.session = self.lab.session(
                prompts, seed=self.seed, num_inference_steps=self.steps, timeout_s=self.timeout_s, **self.session_kwargs
            )
            self.session_seed = self.seed  # set_request may change self.seed before the next reset
            return self.refresh()

        return self._guard(start)

    def step(self) -> Frame:
        return self._advance(lambda session: session.step(timeout_s=self.timeout_s))

    def run(self) -> Frame:
        return self._advance(lambda session: session.run(timeout_s=self.timeout_s))

    def _advance(self, action) -> Frame:
        if self.session is None or self.session.token != self.lab.session_token:
            frame = self.reset()  # none yet, or the Lab moved on (a load or a session from a cell)
            if frame.error:
                return frame
        if self.session.done:
            return self._frame(error=f"all {self.session.num_steps} steps are done: Reset starts a new generation")

        def advance():
            action(self.session)
            return self.refresh()

        return self._guard(advance)

    # ---- what to show ------------------------------------------------------------------------------
    def refresh(self) -> Frame:
        """The views of the session as it stands: shards, staleness (PipeFusion), memory, comm, the last
        step's timeline (after a step), latent."""
        from .views import draw_comm, draw_latent, draw_memory, draw_shards, draw_staleness

        summaries = self.session.summaries(timeout_s=self.timeout_s)
        figures = {"shards": draw_shards(summaries)}
        if self.config.pipefusion > 1:
            figures["staleness"] = draw_staleness(summaries)
        figures["memory"] = draw_memory(summaries)
        figures["comm"] = draw_comm(summaries)
        if self.session.step_index > 0:
            figures["timeline"] = self.session.timeline(timeout_s=self.timeout_s)
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
        return f"{config}; step {s.step_index} of {s.num_steps} ({where}); seed {self.session_seed}"

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


def current_choice(config: ParallelConfig) -> dict:
    """A config's picker values, by picker name."""
    return {name: getattr(config, name) for name in PICKERS}


def config_from(choice: dict) -> ParallelConfig:
    return ParallelConfig(**{name: choice[name] for name in PICKERS})


__all__ = ["ExplorerController", "Frame", "ModelShape", "valid_configs", "explain", "config_from", "current_choice"]
