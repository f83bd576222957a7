"""What the ControlNet pipelines share (FluxControlNetPipeline, StableDiffusion3ControlNetPipeline): their
arguments, checks and refusals, and ControlNetRecipe, the part of a recipe that keeps the control image's latents
and runs the ControlNet before the transformer at every step (each family says how its ControlNet is called,
flux.py and sd3.py).

A ControlNet runs on its transformer's mesh with the family's layout (`CONTROLNET_ADAPTER`): it cuts the same
batch rows and tokens, and hands each block of the transformer its residuals for the tokens this rank holds
(adapter.RankLocal), so nothing of them moves:

    control image --VAE--> latents, cut like the noise --ControlNet--> residuals [B, S/sp, D], one per block fed
    each transformer block it feeds: its states [B, S/sp, D] + scale(step) × that residual

Under PipeFusion the ControlNet runs whole on every rank (its blocks are few), and each stage takes the residuals of
the blocks it holds (adapter.BlockResiduals), cut with the patches.
"""

from __future__ import annotations

from .recipe import Prepared, Recipe, Request

# their arguments and defaults: the control image, the ControlNet's scale and the fraction of the steps it guides
CONTROLNET_OPTIONS = dict(
    control_image=None, controlnet_conditioning_scale=1.0, control_guidance_start=0.0, control_guidance_end=1.0
)


def runs_controlnet(pipe) -> bool:
    return "controlnet" in pipe.components


def check_controlnet(pipe, model_class: str) -> None:
    """Refuse, by name, a ControlNet pipeline's ControlNet that is not one `model_class`, or whose attention is
    not its transformer's (the ControlNet runs on the transformer's mesh, and its traffic is counted as the
    transformer's layers)."""
    controlnet, transformer = pipe.controlnet, pipe.transformer
    if type(controlnet).__name__ != model_class:
        raise NotImplementedError(
            f"{type(controlnet).__name__}: several ControlNets at once are not run by xdit_lab yet; load one {model_class}"
        )
    shape = [(m.config.num_attention_heads, m.config.attention_head_dim) for m in (controlnet, transformer)]
    if shape[0] != shape[1]:
        raise ValueError(
            f"the ControlNet's attention ({shape[0][0]} heads of {shape[0][1]}) is not the transformer's "
            f"({shape[1][0]} of {shape[1][1]}): load the ControlNet made for this transformer"
        )


def check_controlnet_options(pipe, request: Request) -> None:
    """A ControlNet pipeline needs a control image, one scale and a window of the steps; a pipeline without a
    ControlNet takes none of its arguments (each refused by name)."""
    name, options = type(pipe).__name__, request.options
    if not runs_controlnet(pipe):
        given = [key for key, value in CONTROLNET_OPTIONS.items() if options[key] != value]
        if given:
            raise ValueError(
                f"{name} runs no ControlNet and takes no {' or '.join(given)}; a ControlNet's arguments are its "
                f"ControlNet pipeline's (a folder with a controlnet)"
            )
        return
    if options["control_image"] is None:
        raise ValueError(f"{name} is guided by a control image: give control_image= (a PIL image)")
    start, end = options["control_guidance_start"], options["control_guidance_end"]
    scale = options["controlnet_conditioning_scale"]
    if not isinstance(scale, (int, float)) or not 0 <= start < end <= 1:
        raise ValueError(
            f"give controlnet_conditioning_scale as one number (got {scale!r}) and 0 <= control_guidance_start < "
            f"control_guidance_end <= 1 (got {start} and {end}): the fraction of the steps the ControlNet guides"
        )


def controlnet_scales(request: Request) -> list[float]:
    """The ControlNet's scale at each step, as these pipelines set it: controlnet_conditioning_scale where the
    step lies within [control_guidance_start, control_guidance_end] of the steps, 0 outside (it still runs)."""
    options, steps = request.options, request.num_inference_steps
    start, end = options["control_guidance_start"], options["control_guidance_end"]
    keep = [1.0 - float(i / steps < start or (i + 1) / steps > end) for i in range(steps)]
    return [options["controlnet_conditioning_scale"] * k for k in keep]


class ControlNetRecipe(Recipe):
    """A family recipe's ControlNet part, mixed in before its base recipe: the pipeline's ControlNet (one
    `controlnet_model`) and the request's ControlNet arguments checked, the control image's latents kept beside
    the latents (keep_control, from the family's prepare), and at every step the family's ControlNet run on the
    step's input, its residuals added to the transformer's arguments (controlnet_kwargs). The family lists
    CONTROLNET_OPTIONS among its options. A StepCache runs with it: the residuals the forward adds between blocks
    are added fresh at a skipped step, never cached (models/cache.py)."""

    controlnet_model = ""  # the ControlNet class the family's pipeline runs
    image_inputs = (*Recipe.image_inputs, "control")  # the control image's latents

    def check_pipeline(self, pipe):
        super().check_pipeline(pipe)
        if runs_controlnet(pipe):
            check_controlnet(pipe, self.controlnet_model)
            self.check_controlnet(pipe)

    def check_controlnet(self, pipe) -> None:
        """Refuse, by name, a `controlnet_model` whose layout the family does not run."""

    def check_inputs(self, pipe, request):
        super().check_inputs(pipe, request)
        check_controlnet_options(pipe, request)

    def keep_control(self, prepared: Prepared, request: Request, latents) -> None:
        """Keep the control image's latents, and the ControlNet's scale at each step (controlnet_scales)."""
        prepared.extra["control"] = latents
        prepared.extra["control_scales"] = controlnet_scales(request)

    def model_kwargs(self, pipe, prepared, model_input, t):
        kwargs = super().model_kwargs(pipe, prepared, model_input, t)
        control = prepared.extra.get("control")
        if control is None:
            return kwargs
        scale = prepared.extra["control_scales"][prepared.step_index]
        return kwargs | self.controlnet_kwargs(pipe, prepared, model_input, kwargs, control, scale)

    def controlnet_kwargs(self, pipe, prepared: Prepared, model_input, kwargs: dict, control, scale: float) -> dict:
        """The ControlNet's residuals for this step, as the transformer's arguments: the ControlNet run on
        `model_input` and the transformer's own `kwargs`, given the control image's latents at `scale`."""
        raise NotImplementedError
