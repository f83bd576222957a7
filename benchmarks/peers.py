"""Speed against the peers, side by side in one run: serial diffusers, diffusers' own context
parallelism (`ContextParallelConfig`), and xdit_lab's Ulysses, Ring and USP, on the same weights.

    python benchmarks/peers.py                       # transformers and pipelines, 2 and 4 ranks
    python benchmarks/peers.py --tokens 1024 4096 16384 --ranks 2 --repeats 7 --json out.json
    python benchmarks/peers.py --pipeline-tokens     # transformers only (an empty list: no pipelines)
    python benchmarks/peers.py --device cuda         # transformers, every rank on cuda:0 over gloo
    python benchmarks/peers.py --families flux --text-tokens 512 --pipeline-tokens   # FLUX.1-dev's prompt length

What is timed:
  transformer  one forward of a Flux-shaped (joint text) and a PixArt-shaped (self + cross
               attention) transformer, on the image tokens given, beside 64 text tokens
               (--text-tokens); every method runs the same weights (seeded) and the same inputs.
  pipeline     `pipe(prompt, output_type="latent")` end to end, Flux-shaped, against diffusers'
               FluxPipeline with context parallelism enabled on its transformer.
Runs are interleaved (method A, B, C, A, B, C, ...) so that a slow spell of the machine hits all
methods alike; each figure is the median over repeats of the slowest rank, with the spread
(min-max). Serial runs on rank 0 alone, one thread, while the other ranks wait. Every rank runs
one thread: on a machine with fewer cores than ranks, ranks compete for cores, so read ratios
between methods; speed-ups over serial are only meaningful where each rank has a core (or GPU).

Also reported: the largest error of each method's output against serial (relative to serial's
largest magnitude), and for ours the bytes each rank sent (recorded by comm_log) beside the
closed form (`closed_form_bytes`, which asks the package's `expected_bytes_per_step`).

diffusers' context parallelism on CPU needs one patch, inside this file and only around its
`enable_parallelism` call: `torch.accelerator.device_count()` is 0 without an accelerator and
diffusers takes `rank % device_count` for the device, so it is made to answer 1 (every rank
"owns" the CPU). The device mesh is then built for device type "cpu" over gloo, and diffusers'
Ulysses all-to-alls run there. Its Ring needs an attention backend that returns the log-sum-exp,
and the native (CPU) backend does not: that row reports diffusers' own refusal.
PixArt's attention processor calls SDPA directly and PixArt ships no `_cp_plan`, so diffusers
cannot run PixArt under context parallelism at all; its rows say so.

`--device cuda` puts every rank's model and inputs on cuda:0, the ranks sharing one GPU over gloo
(NCCL refuses two ranks on one GPU; gloo moves CUDA tensors through host memory): the kernels are
the GPU's, the transfers are not a GPU link's. Each timed call ends with a device synchronize.
Pipelines are timed on CPU only.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import os
import statistics
import tempfile
import time
import warnings
from unittest import mock

import torch
import torch.distributed as dist

from xdit_lab import ParallelConfig, RankMesh, comm_log, parallelize
from xdit_lab.pipeline import loading_bars_hidden
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import TEXT_DIM, tiny_pipeline, tiny_transformer
from xdit_lab.traffic import expected_bytes_per_step

HEADS, HEAD_DIM, BLOCKS, TEXT_TOKENS = 8, 64, 3, 64

OURS = {
    2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2)],
    4: [ParallelConfig(ulysses=4), ParallelConfig(ring=4), ParallelConfig(ulysses=2, ring=2)],
}


# ---- models and inputs ---------------------------------------------------------------------


def build_model(family: str):
    """A transformer of `family` at HEADS x HEAD_DIM, BLOCKS attention blocks; identical on every rank."""
    if family == "flux":  # one double-stream block, the rest single-stream (Flux's own mix, scaled down)
        return tiny_transformer(
            "flux",
            heads=HEADS,
            layers=1,
            num_single_layers=BLOCKS - 1,
            attention_head_dim=HEAD_DIM,
            axes_dims_rope=(16, 24, 24),
            in_channels=64,
        )
    if family == "pixart":
        return tiny_transformer(
            "pixart",
            heads=HEADS,
            layers=BLOCKS,
            attention_head_dim=HEAD_DIM,
            cross_attention_dim=HEADS * HEAD_DIM,
            sample_size=128,
        )
    raise ValueError(f"unknown family {family!r}")


def build_inputs(family: str, tokens: int, text_tokens: int = TEXT_TOKENS) -> dict:
    side = int(tokens**0.5)
    if side * side != tokens:
        raise ValueError(f"{tokens} image tokens is not a square number; use e.g. 1024, 4096 or 16384")
    g = torch.Generator().manual_seed(1)
    text = torch.randn(1, text_tokens, TEXT_DIM, generator=g)
    if family == "flux":
        ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(float(side)), torch.arange(float(side)), indexing="ij"), -1
        )
        return dict(
            hidden_states=torch.randn(1, tokens, 64, generator=g),
            encoder_hidden_states=text,
            pooled_projections=torch.randn(1, TEXT_DIM, generator=g),
            timestep=torch.tensor([0.5]),
            img_ids=ids.reshape(tokens, 3).float(),
            txt_ids=torch.zeros(text_tokens, 3),
            return_dict=False,
        )
    side *= 2  # PixArt patches 2 x 2 latent pixels into a token
    return dict(
        hidden_states=torch.randn(1, 4, side, side, generator=g),
        encoder_hidden_states=text,
        timestep=torch.tensor([500]),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None},
        return_dict=False,
    )


def closed_form_bytes(family: str, mesh: RankMesh, tokens: int, text_tokens: int = TEXT_TOKENS) -> int:
    """Bytes this rank sends in one forward (fp32), from the package's own closed forms
    (xdit_lab.lab.summaries.expected_bytes_per_step, which derives them term by term): every
    attention of both models is sequence-parallel, Flux's all joint (text_tokens beside the image), PixArt's
    self-attention beside a cross-attention that moves nothing."""
    side = int(tokens**0.5)
    joint = BLOCKS if family == "flux" else 0
    shapes = dict(
        batch=1,
        rows=side,
        cols=side,
        heads=HEADS,
        head_dim=HEAD_DIM,
        text_len=text_tokens,
        proj_width={"flux": 64, "pixart": 2 * 2 * 8}[family],  # Flux: 64 packed channels; PixArt: a 2 x 2 patch of 8
        joint_layers=joint,
        self_layers=BLOCKS - joint,
        dtype_bytes=4,
    )
    return sum(expected_bytes_per_step(mesh.config, shapes, coords=mesh.coords).values())


# ---- methods -------------------------------------------------------------------------------


@contextlib.contextmanager
def diffusers_cp_on_cpu():
    """Patch 1 of the module docstring: one 'device' per rank when torch sees no accelerator."""
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def diffusers_cp(model, ulysses: int = 1, ring: int = 1):
    """diffusers' own context parallelism on a copy of `model`; raises diffusers' error if it cannot."""
    from diffusers import ContextParallelConfig

    model = copy.deepcopy(model)
    with diffusers_cp_on_cpu():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    return model


def peer_transformers(model, ranks: int) -> tuple[dict, dict]:
    """{name: model with diffusers' CP} and {name: why diffusers refused}."""
    runnable, refused = {}, {}
    for name, degrees in peer_degrees(ranks):
        try:
            runnable[name] = diffusers_cp(model, **degrees)
        except Exception as error:  # diffusers' own refusal is the finding
            refused[name] = refusal(error)
    return runnable, refused


def peer_degrees(ranks: int):
    return ((f"diffusers ulysses{ranks}", dict(ulysses=ranks)), (f"diffusers ring{ranks}", dict(ring=ranks)))


def refusal(error: Exception) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


# ---- timing --------------------------------------------------------------------------------


def measure(run_serial, methods: dict, refused: dict, repeats: int) -> tuple[dict, dict, object]:
    """Time `run_serial()` (rank 0 alone) and each `methods[name]()` (all ranks at once), interleaved.

    A peer that refuses only when it runs (diffusers' Ring) moves from `methods` to `refused`.
    Returns ({name: [ms per repeat]}, {name: last output}, serial output on rank 0 else None)."""
    rank = dist.get_rank()
    serial_out = run_serial() if rank == 0 else None  # also its warm-up
    for name, run in list(methods.items()):  # warm-up
        try:
            run()
        except Exception as error:
            if not name.startswith("diffusers"):
                raise  # ours must run
            refused[name] = refusal(error)
            del methods[name]
    times = {name: [] for name in ["serial", *methods]}
    outputs = {}
    for _ in range(repeats):
        if rank == 0:
            start = time.perf_counter()
            run_serial()
            times["serial"].append((time.perf_counter() - start) * 1e3)
        for name, run in methods.items():
            dist.barrier()  # all ranks start together; the slowest rank's time is taken later
            start = time.perf_counter()
            outputs[name] = run()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times, outputs, serial_out


def rows_for(kind, family, tokens, times, outputs, serial_out, refused, extra=None) -> list[dict]:
    ranks = dist.get_world_size()
    rows = []
    for name, output in outputs.items():
        error = None
        if serial_out is not None:
            error = (output - serial_out).abs().max().item() / serial_out.abs().max().item()
        row = dict(kind=kind, family=family, tokens=tokens, ranks=ranks, method=name, ms=times[name])
        rows.append(dict(row, serial_ms=times["serial"], max_rel_error=error, **(extra or {}).get(name, {})))
    for name, why in refused.items():
        rows.append(dict(kind=kind, family=family, tokens=tokens, ranks=ranks, method=name, refused=why))
    return rows


def forward(model, inputs):
    with torch.inference_mode():
        out = model(**inputs)[0]
    if out.is_cuda:
        torch.cuda.synchronize(out.device)  # the timer reads the host clock: wait for the kernels
    return out


def to_device(inputs: dict, device: torch.device) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def bench_transformer(
    family: str,
    tokens_list: list[int],
    repeats: int,
    device: str = "cpu",
    with_diffusers: bool = True,
    text_tokens: int = TEXT_TOKENS,
) -> list[dict]:
    """One forward of `family`'s transformer per method. Runs on every rank; returns rank's rows."""
    torch.set_num_threads(1)
    quiet_peers()
    device = torch.device(device)
    model = build_model(family).to(device)
    peers, refused = peer_transformers(model, dist.get_world_size()) if with_diffusers else ({}, {})
    meshes = [RankMesh(c) for c in OURS[dist.get_world_size()]]
    ours = {f"ours {m.config.short()}": (parallelize(copy.deepcopy(model), m.config, m), m) for m in meshes}
    rows = []
    for tokens in tokens_list:
        inputs = to_device(build_inputs(family, tokens, text_tokens), device)
        methods = {name: functools.partial(forward, m, inputs) for name, m in peers.items()}
        methods |= {name: functools.partial(forward, m, inputs) for name, (m, _) in ours.items()}
        refused_now = dict(refused)
        times, outputs, serial_out = measure(functools.partial(forward, model, inputs), methods, refused_now, repeats)
        traffic = {}
        for name, (m, mesh) in ours.items():
            with comm_log() as log:
                forward(m, inputs)
            traffic[name] = dict(
                bytes_sent=sum(r.bytes_out for r in log),
                closed_form=closed_form_bytes(family, mesh, tokens, text_tokens),
            )
        rows += rows_for("transformer", family, tokens, times, outputs, serial_out, refused_now, traffic)
    return [dict(row, device=str(device), text_tokens=text_tokens) for row in rows]


def load_pipelines(folder: str, ranks: int):
    """Serial diffusers, diffusers with context parallelism, and ours, from the same folder."""
    from diffusers import FluxPipeline

    from xdit_lab import load_pipeline

    def stock():
        pipe = FluxPipeline.from_pretrained(folder)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    runnable, refused = {}, {}
    for name, degrees in peer_degrees(ranks):
        pipe = stock()
        try:
            pipe.transformer = diffusers_cp(pipe.transformer, **degrees)
            runnable[name] = pipe
        except Exception as error:
            refused[name] = refusal(error)
    for config in OURS[ranks]:
        runnable[f"ours {config.short()}"] = load_pipeline(folder, config, progress=False)
    return runnable, refused, stock()


def generate(pipe, side: int, steps: int):
    with torch.inference_mode():
        return pipe(
            "a photo of a cat",
            height=side,
            width=side,
            num_inference_steps=steps,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
            max_sequence_length=8,
        ).images


def bench_pipeline(folder: str, tokens_list: list[int], steps: int, repeats: int) -> list[dict]:
    """`pipe(prompt, output_type="latent")` of the Flux-shaped pipeline in `folder`: serial diffusers,
    diffusers with context parallelism on its transformer, and ours (load_pipeline). Every rank."""
    torch.set_num_threads(1)
    quiet_peers()
    with loading_bars_hidden():
        pipes, refused, serial = load_pipelines(folder, dist.get_world_size())
    rows = []
    for tokens in tokens_list:
        side = int(tokens**0.5) * 2 * serial.vae_scale_factor  # Flux packs 2 x 2 latent pixels per token
        methods = {name: functools.partial(generate, pipe, side, steps) for name, pipe in pipes.items()}
        refused_now = dict(refused)
        times, outputs, serial_out = measure(
            functools.partial(generate, serial, side, steps), methods, refused_now, repeats
        )
        rows += rows_for("pipeline", "flux pipe", tokens, times, outputs, serial_out, refused_now)
    return rows


def save_flux_pipeline(folder) -> str:
    """The tiny Flux pipeline (random text encoders, VAE) around the Flux-shaped transformer."""
    pipe = tiny_pipeline("flux")
    pipe.register_modules(transformer=build_model("flux"))
    with loading_bars_hidden():
        pipe.save_pretrained(folder, safe_serialization=True)
    return str(folder)


def quiet_peers():
    """diffusers warns that enable_parallelism is experimental and that torch deprecates a collective
    it calls, once per rank: said once in the module docstring instead."""
    from diffusers.utils import logging

    logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4], choices=[2, 4])
    parser.add_argument("--families", nargs="+", default=["flux", "pixart"], choices=["flux", "pixart"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--text-tokens",
        type=int,
        default=TEXT_TOKENS,
        help=f"joint text tokens beside the image, transformers (default {TEXT_TOKENS}; FLUX.1-dev's prompt: 512)",
    )
    parser.add_argument("--pipeline-steps", type=int, default=4)
    parser.add_argument(
        "--pipeline-tokens",
        type=int,
        nargs="*",
        help="image tokens of the pipeline runs (default: --tokens up to 4096)",
    )
    parser.add_argument("--pipeline-ranks", type=int, nargs="*", choices=[2, 4], help="default: --ranks")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: every rank on cuda:0, over gloo (transformers)"
    )
    parser.add_argument("--json", help="also write every row (all timings) to this file")
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    parser.add_argument("--plot", help="also draw the medians to this PNG")
    parser.add_argument(
        "--without-diffusers", action="store_true", help="time serial and ours only (transformers), no diffusers' CP"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here (python -m xdit_lab.env says why)")
    if args.device == "cuda" and args.pipeline_tokens:
        parser.error("--device cuda times transformers only; leave out --pipeline-tokens")
    rows = []
    for ranks in args.ranks:
        for family in args.families:
            per_rank = run_on_ranks(
                bench_transformer,
                ranks,
                family,
                args.tokens,
                args.repeats,
                args.device,
                not args.without_diffusers,
                args.text_tokens,
                timeout_s=7200,
            )
            rows += merge_ranks(per_rank)
    pipeline_tokens = [t for t in args.tokens if t <= 4096] if args.pipeline_tokens is None else args.pipeline_tokens
    if args.device == "cuda":
        pipeline_tokens = []
    pipeline_ranks = args.ranks if args.pipeline_ranks is None else args.pipeline_ranks
    if pipeline_tokens and pipeline_ranks:
        with tempfile.TemporaryDirectory() as tmp:
            folder = save_flux_pipeline(tmp)
            for ranks in pipeline_ranks:
                per_rank = run_on_ranks(
                    bench_pipeline, ranks, folder, pipeline_tokens, args.pipeline_steps, args.repeats, timeout_s=7200
                )
                rows += merge_ranks(per_rank)
    print_table(rows)
    for path, text in ((args.json, lambda: json.dumps(rows, indent=1)), (args.markdown, lambda: markdown_table(rows))):
        if path:
            write_whole(path, text())
    if args.plot:
        plot(rows, args.plot)


def write_whole(path, text: str):
    """Write to a neighbour, then rename: an interrupted run leaves no half-written file."""
    tmp = f"{path}.partial"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def merge_ranks(per_rank: list[list[dict]]) -> list[dict]:
    """Rank 0's rows, each timing replaced by the slowest rank's for that repeat."""
    merged = []
    for i, row in enumerate(per_rank[0]):
        if "ms" in row:
            row = dict(row, ms=[max(rank_rows[i]["ms"][j] for rank_rows in per_rank) for j in range(len(row["ms"]))])
        merged.append(row)
    return merged


COLUMNS = (
    "model",
    "tokens",
    "ranks",
    "method",
    "median ms",
    "spread ms",
    "serial / this",
    "this / diffusers",
    "max rel err",
    "bytes/rank",
    "closed form",
)


def table_rows(rows) -> list[tuple]:
    """The printed table: one tuple of strings per row, in COLUMNS order."""
    medians = {
        (r["family"], r["tokens"], r["ranks"], r["method"]): statistics.median(r["ms"]) for r in rows if "ms" in r
    }
    out = []
    for row in rows:
        head = (row["family"], str(row["tokens"]), str(row["ranks"]), row["method"])
        if "refused" in row:
            continue  # listed under the table (refusals)
        med, serial = statistics.median(row["ms"]), statistics.median(row["serial_ms"])
        peer = medians.get((row["family"], row["tokens"], row["ranks"], f"diffusers ulysses{row['ranks']}"))
        out.append(
            head
            + (
                f"{med:.1f}",
                f"{min(row['ms']):.0f}-{max(row['ms']):.0f}",
                f"{serial / med:.2f}",
                f"{med / peer:.2f}" if peer else "-",
                f"{row['max_rel_error']:.1e}",
                *(f"{row[key]:,}" if row.get(key) is not None else "-" for key in ("bytes_sent", "closed_form")),
            )
        )
    return out


def refusals(rows) -> list[str]:
    """One line per peer and model that refused to run, with diffusers' own words (once, not per size)."""
    seen = {}
    for r in rows:
        if "refused" in r:
            seen.setdefault((r["method"], r["family"], r["ranks"]), r["refused"])
    return [f"{method} on {family}, {ranks} ranks: {why}" for (method, family, ranks), why in seen.items()]


def print_table(rows):
    body = table_rows(rows)
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(COLUMNS)]
    for line in [COLUMNS, *body]:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)).rstrip())
    for line in refusals(rows):
        print("refused:", line)


def markdown_table(rows) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(r) + " |" for r in table_rows(rows)]
    lines += [""] + [f"- refused: {line}" for line in refusals(rows)]
    return "\n".join(lines)


def plot(rows, path):
    """Speed-up over serial against image tokens, one panel per (model, ranks), one line per method
    (one colour per method across panels), with the limit this machine's cores set."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = [r for r in rows if "ms" in r]
    panels = sorted({(r["family"], r["ranks"]) for r in timed})
    methods = sorted({r["method"] for r in timed})
    colours = {m: f"C{i}" for i, m in enumerate(methods)}
    on_gpu = any(r.get("device", "cpu").startswith("cuda") for r in timed)  # every rank on one GPU
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False, sharey=True)
    for ax, (family, ranks) in zip(axes[0], panels):
        mine = [r for r in timed if r["family"] == family and r["ranks"] == ranks]
        for method in methods:
            points = sorted(
                (r["tokens"], statistics.median(r["serial_ms"]) / statistics.median(r["ms"]))
                for r in mine
                if r["method"] == method
            )
            if points:
                ax.plot(*zip(*points), marker="o", color=colours[method], label=method)
        limit = 1 if on_gpu else min(ranks, os.cpu_count() or ranks)
        ax.axhline(limit, color="grey", linestyle=":", label="one GPU's limit" if on_gpu else f"{limit} cores' limit")
        ax.set(xscale="log", xlabel="image tokens", title=f"{family}, {ranks} ranks")
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("speed-up over serial (same GPU)" if on_gpu else "speed-up over serial (1 thread)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
