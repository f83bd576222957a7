"""Explorer: ipywidgets over an ExplorerController (explorer.py), nothing more.

Every button and picker calls one controller method and shows the Frame it returns. The views
are PNG images in a Box whose children are replaced on each refresh (rather than an Output
widget that `display()`s into it): the same code then works, and is tested, without a kernel.
Any exception in a callback is shown in the panel's error area; ipywidgets would otherwise send
it to the browser console or the kernel log, where nobody sees it.
"""

from __future__ import annotations

import base64
import html
import io
import traceback

import ipywidgets as w

from ..config import GRID
from .explorer import PICKERS, ExplorerController, config_from, current_choice
from .views import DPI

LABELS = {
    "num_patches": "patches",
    "warmup_steps": "warmup",
    "pipefusion_schedule": "schedule",
}  # the degrees keep their own names
ORDER = (
    "latent",
    "shards",
    "staleness",
    "memory",
    "comm",
    "timeline",
    "history",
)  # views, left to right, top to bottom


def figure_png(figure, dpi: int = DPI) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    return buffer.getvalue()


class Explorer:
    """The panel: valid configurations, degree pickers (an invalid choice says why), prompt,
    steps, seed, Step / Run / Reset, the rank table, the status line, errors and the views; Plan ranks
    the configurations for a number of GPUs the Lab does not have, Plan model what of a model folder fits
    that many GPUs of a given memory; snapshot() keeps the panel as HTML."""

    def __init__(self, lab, **kwargs):
        self.controller = c = ExplorerController(lab, **kwargs)
        self._syncing = False  # set while code (not the user) moves the pickers
        small = w.Layout(width="150px")
        self.configs = w.Dropdown(description="valid", layout=w.Layout(width="320px"))
        self.pickers = {
            name: w.Dropdown(description=LABELS.get(name, name), layout=small, style={"description_width": "70px"})
            for name in PICKERS
        }
        self.apply_button = w.Button(description="Apply", tooltip="load the pipeline under the picked degrees")
        self.verdict = w.HTML()
        self.prompt = w.Text(
            value=c.prompt,
            description="prompt",
            placeholder="several prompts: separate with ;",
            layout=w.Layout(width="420px"),
        )
        self.steps = w.BoundedIntText(value=c.steps, min=1, max=1000, description="steps", layout=small)
        self.seed = w.IntText(value=c.seed, description="seed", layout=small)
        self.buttons = {name: w.Button(description=name.capitalize()) for name in ("step", "run", "reset")}
        self.gpus = w.BoundedIntText(value=8, min=1, max=4096, description="plan for", layout=small)
        self.plan_button = w.Button(description="Plan", tooltip="rank the configurations for this many GPUs")
        self.plan_folder = w.Text(description="model", placeholder="a model folder (blank: the loaded model)")
        self.plan_memory = w.Text(value="24GB", description="GPU memory", layout=w.Layout(width="200px"))
        self.plan_folder_button = w.Button(description="Plan model", tooltip="what fits these GPUs, from the headers")
        self.plan_folder.add_class("xdit-lab-plan-folder")
        self.plan_memory.add_class("xdit-lab-plan-memory")
        self.table, self.status, self.error, self.plan = w.HTML(), w.HTML(), w.HTML(), w.HTML()
        for name in ("table", "status", "error", "plan"):  # CSS classes name the parts (a browser test finds them)
            getattr(self, name).add_class(f"xdit-lab-{name}")
        self.gpus.add_class("xdit-lab-plan-gpus")
        self.views = w.Box(layout=w.Layout(flex_flow="row wrap", align_items="flex-start"))
        self.panel = w.VBox(
            [
                self.table,
                self.configs,
                w.HBox(list(self.pickers.values())[: len(GRID)]),  # the degrees, tp among them
                w.HBox([*list(self.pickers.values())[len(GRID) :], self.apply_button]),  # PipeFusion's knobs
                self.verdict,
                w.HBox([self.gpus, w.Label("GPUs"), self.plan_button]),
                w.HBox([self.plan_folder, self.plan_memory, self.plan_folder_button]),
                self.plan,
                w.HBox([self.prompt, self.steps, self.seed]),
                w.HBox(list(self.buttons.values())),
                self.status,
                self.error,
                self.views,
            ]
        )

        self._fill_choices()
        self.configs.observe(self._safely(self._on_config), names="value")
        for picker in self.pickers.values():
            picker.observe(self._safely(self._on_picker), names="value")
        self.apply_button.on_click(self._safely(lambda _: self.apply()))
        self.plan_button.on_click(self._safely(lambda _: self.show_plan()))
        self.plan_folder_button.on_click(self._safely(lambda _: self.show_folder_plan()))
        for name, button in self.buttons.items():
            button.on_click(self._safely(lambda _, name=name: getattr(self, name)()))
        self.show(c.reset())

    # ---- actions (also callable from code, as the buttons call them) --------------------------------
    def step(self):
        self._busy(lambda: self._advance("step"))

    def run(self):
        self._busy(lambda: self._advance("run"))

    def reset(self):
        self._take_request()
        self._busy(self.controller.reset)

    def apply(self):
        self._take_request()
        self._busy(lambda: self.controller.apply_config(config_from(self._picked())))
        self._fill_choices()  # the table's roles changed; the pickers follow the loaded config

    def show_plan(self):
        """Planning mode: the ranking for the GPUs asked for, with this model and the prompts shown."""
        self._take_request()
        text = self.controller.plan(self.gpus.value)
        self.plan.value = f"<pre style='font-size:11px;white-space:pre;overflow-x:auto'>{html.escape(text)}</pre>"

    def show_folder_plan(self):
        """Planning mode for a model folder: what each way to run it holds per rank on the GPUs asked for,
        best first, and the smallest GPU that would fit when nothing does (lab/folder_planning.py)."""
        from .folder_planning import folder_plan_html

        try:
            plan = self.controller.plan_folder(self.plan_folder.value, self.gpus.value, self.plan_memory.value)
        except ValueError as error:  # the folder or the memory typed in: say what is wrong
            self.plan.value = f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(str(error))}</pre>"
            return
        self.plan.value = folder_plan_html(plan)

    def snapshot(self):
        """The panel as it looks now, as static HTML (status, error, plan and the views as PNGs): what a
        saved notebook shows where the live widget needs a kernel."""
        from IPython.display import HTML

        images = "".join(
            f"<img src='data:image/png;base64,{base64.b64encode(view.value).decode()}' alt='{view._dom_classes[0]}'>"
            for view in self.views.children
        )
        return HTML(
            f"<div class='xdit-lab-snapshot'>{self.status.value}{self.error.value}{self.plan.value}"
            f"<div style='display:flex;flex-wrap:wrap;align-items:flex-start'>{images}</div></div>"
        )

    def _advance(self, action):
        if self._take_request():  # prompt, steps or seed changed: Step and Run begin a new generation
            frame = self.controller.reset()
            if frame.error:
                return frame
        return getattr(self.controller, action)()

    def _take_request(self) -> bool:
        """Hand the prompt, steps and seed to the controller; True when they changed."""
        c = self.controller
        new = (self.prompt.value, self.steps.value, self.seed.value)
        changed = new != (c.prompt, c.steps, c.seed)
        c.set_request(prompt=new[0], steps=new[1], seed=new[2])
        return changed

    # ---- pickers ------------------------------------------------------------------------------------
    def _picked(self) -> dict:
        return {name: picker.value for name, picker in self.pickers.items()}

    def _fill_choices(self):
        """Offer the valid configurations and, per picker, the values some valid one uses."""
        c = self.controller
        self._syncing = True
        try:
            options = c.options()
            self.configs.options = [(f"{o.short()}  ({o.world_size} of {c.engines} ranks)", o) for o in options]
            self.configs.value = c.config if c.config in options else None
            current = current_choice(c.config)
            for name, values in c.choices().items():
                if current[name] not in values:  # e.g. a longer warmup loaded from code: still shown
                    values = [*values, current[name]]
                self.pickers[name].options = [("one per stage" if v is None else str(v), v) for v in values]
                self.pickers[name].value = current[name]
        finally:
            self._syncing = False
        self.table.value = c.lab._repr_html_()
        self._judge()

    def _on_config(self, change):
        if self._syncing or change["new"] is None:
            return
        self._syncing = True
        try:  # the dropdown only offers valid configurations: load the one picked at once
            for name, value in current_choice(change["new"]).items():
                self.pickers[name].value = value
        finally:
            self._syncing = False
        self.apply()

    def _on_picker(self, change):
        if not self._syncing:
            self._judge()

    def _judge(self):
        """Say whether the picked degrees can run, and why not; Apply only what can."""
        config = config_from(self._picked())
        problems = self.controller.explain(config)
        self.apply_button.disabled = bool(problems)
        if problems:
            items = "".join(f"<li>{html.escape(p)}</li>" for p in problems)
            self.verdict.value = f"<b style='color:#b00'>{html.escape(config.short())} cannot run:</b><ul>{items}</ul>"
        elif config == self.controller.config:
            self.verdict.value = f"<span>{html.escape(config.spelled())} ranks: loaded</span>"
        else:
            self.verdict.value = (
                f"<span style='color:#070'>{html.escape(config.spelled())} ranks: valid, Apply loads it</span>"
            )

    # ---- showing ------------------------------------------------------------------------------------
    def show(self, frame):
        self.status.value = f"<code>{html.escape(frame.status)}</code>"
        self.error.value = (
            f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(frame.error)}</pre>" if frame.error else ""
        )
        if frame.details:
            self.error.value += (
                f"<details><summary>remote tracebacks</summary><pre style='white-space:pre-wrap'>"
                f"{html.escape(frame.details)}</pre></details>"
            )
        if frame.figures:  # an error frame keeps the last views on screen
            names = sorted(frame.figures, key=ORDER.index)
            self.views.children = [
                w.Image(value=figure_png(frame.figures[n]), format="png").add_class(f"xdit-lab-view-{n}") for n in names
            ]

    def _busy(self, action):
        """Run a controller action with the buttons disabled; show its frame."""
        controls = [*self.buttons.values(), self.apply_button, self.configs]
        for control in controls:
            control.disabled = True
        try:
            self.show(action())
        finally:
            for control in controls:
                control.disabled = False
            self._judge()  # Apply is enabled again only for a valid choice

    def _safely(self, callback):
        def wrapped(*args):
            try:
                callback(*args)
            except Exception:  # noqa: BLE001 - a callback's error must reach the panel, whatever it is
                self.error.value = (
                    f"<pre style='color:#b00;white-space:pre-wrap'>{html.escape(traceback.format_exc())}</pre>"
                )

        return wrapped

    def _repr_mimebundle_(self, **kwargs):
        return self.panel._repr_mimebundle_(**kwargs)
