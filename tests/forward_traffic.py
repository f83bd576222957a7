"""The closed-form traffic of parallel transformer forwards that tests call outside a DenoiseSession.

A session's rank summary carries the `shapes` that xdit_lab.traffic.expected_bytes_per_step needs
(xdit_lab/lab/summaries.py reads them from the session). A test that calls a parallelized transformer
directly, one call per diffusion step, has no session: `forward_shapes` reads the same sizes from the
model this rank holds and the call's inputs, and `traffic_rows` puts each call's measured bytes (comm_log)
beside the closed form, so the test can assert that they are equal, group by group, step by step.

Not a test module (pytest collects test_*.py only); the test modules import it, and so do their ranks.
"""

from __future__ import annotations

import inspect

import torch

from xdit_lab.models import kept_block_names, local_mixing_layers, other_traffic_sizes, parallel_state
from xdit_lab.models.tensor_parallel import tp_shapes
from xdit_lab.traffic import expected_bytes_per_step


def sample(output) -> torch.Tensor:
    """A forward's output sample: a tensor, or one tensor per sample (Z-Image's list), stacked."""
    return torch.stack(output.sample) if isinstance(output.sample, list) else output.sample


def forward_shapes(model, inputs: dict) -> dict:
    """The sizes the closed forms need, for one call of the parallelized `model` on `inputs` (read after
    the call: the text length is the last forward's). As rank_summary's `shapes`."""
    state = parallel_state(model)
    adapter = state.adapter
    arguments = inspect.signature(type(model).forward).bind(model, **inputs).arguments
    latents = inputs[adapter.latents_argument]  # a tensor, or a list of one per sample (Z-Image)
    rows, cols = adapter.latents.token_grid(latents, model.config, arguments)
    appended = adapter.latents.appended_grids(arguments)  # an edit's reference images, after the drawn one
    heads, head_dim = adapter.attention_shape(model.config)
    named_kinds = [(name, adapter.attention_kind(name)) for name, _ in model.named_modules()]
    kinds = [kind for _, kind in named_kinds]
    # the attention layers a StepCache runs at a skipped step: the first block's (on the first stage), DBCache's
    # front and back blocks'
    kept = tuple(kept_block_names(model, state))
    first = [k for n, k in named_kinds if n.startswith(kept)] if kept else []
    return dict(
        batch=len(latents),  # the model's batch: both CFG branches when cfg splits them
        rows=rows,
        cols=cols,
        appended_tokens=sum(r * c for r, c in appended),
        appended_grids=[list(grid) for grid in appended],
        padded_tokens=adapter.latents.padded_tokens(rows * cols, model.config),  # Z-Image's, to a multiple of 32
        heads=heads,
        head_dim=head_dim,
        self_layers=kinds.count("self"),
        joint_layers=sum(1 for k in kinds if k and k.startswith("joint")),
        first_block_self_layers=first.count("self"),
        **local_mixing_layers(adapter, model),
        **other_traffic_sizes(adapter, model),
        first_block_joint_layers=sum(1 for k in first if k and k.startswith("joint")),
        text_len=state.text_len,
        text_sharded=state.strategy.text_shard_at is not None,  # whole under PipeFusion and the control
        handed_text=state.strategy.report().hands_text,
        proj_width=model.get_submodule(adapter.gather_at).out_features,
        dtype_bytes=next(model.parameters()).element_size(),
        **_tensor_parallel(model, adapter, inputs),
    )


def _tensor_parallel(model, adapter, inputs: dict) -> dict:
    """A model split over tp ranks: its split layers (tensor_parallel.tp_shapes), and a cross attention's text."""
    record = parallel_state(model).tensor
    if record is None:
        return {}
    text = inputs.get("encoder_hidden_states")
    return dict(tp=tp_shapes(model, record, adapter), cross_text_len=0 if text is None else text.shape[1])


def moved(log) -> dict[str, int]:
    """Bytes out of this rank per group in a comm_log, groups that moved nothing left out."""
    return {group: n for group, n in log.bytes_by_group().items() if n}


def traffic_row(model, inputs: dict, log, step: int) -> dict:
    """One call's measured bytes beside expected_bytes_per_step for this rank at `step` (told the steps a
    StepCache skipped, where the model has one)."""
    state = parallel_state(model)
    skips = list(state.cache.skips) if state.cache is not None else None
    expected = expected_bytes_per_step(
        state.mesh.config, forward_shapes(model, inputs), coords=dict(state.mesh.coords), step=step, cache_skips=skips
    )
    return dict(moved=moved(log), expected=expected)


def traffic_mismatches(rows, where: str = "") -> list[str]:
    """Every row whose measured bytes differ from the closed form (rows of traffic_row, or dicts with
    `moved` and `expected`), said step by step; empty when all are equal."""
    return [
        f"{where} step {step}: measured {row['moved']}, closed form {row['expected']}"
        for step, row in enumerate(rows)
        if row["moved"] != row["expected"]
    ]


def session_traffic(session) -> list[dict]:
    """A session's steps: measured bytes per group beside the closed form (its rank summary's)."""
    from xdit_lab.lab.summaries import rank_summary

    comm = rank_summary(session)["comm"]
    return [
        dict(moved={g: n for g, n in measured.items() if n}, expected=expected)
        for measured, expected in zip(comm["measured"], comm["expected"])
    ]
