"""xdit-lab: the command-line driver, one function per subcommand (registered in `_build_parser`).

    xdit-lab plan [--world-size N] [--heads H] [--layers L] [--seq-len S] [--hidden-size HS]
                  [--batch B] [--no-cfg] [--no-tp] [--top K] [--why]
    xdit-lab plan --model FOLDER --world-size N --gpu-memory 24GB [--dtype bfloat16] [--height H --width W]
                  [--json] [--top K] [--wide] [--why]
    torchrun --nproc_per_node N -m xdit_lab.cli run --model PATH --prompt TEXT [--cfg 2 --ulysses 2 ...]
    torchrun --nproc_per_node N -m xdit_lab.cli run --model PATH --prompts FILE [--images-per-prompt K]
                  [--batch-size B] --output DIR ...   (a rerun into DIR resumes)
    xdit-lab demo [--ranks N] [--cfg 2 ...]
    xdit-lab compare RUN_A RUN_B [--output DIR]

`plan` ranks every parallel configuration that fits N ranks with ParallelConfig's cost model
(see xdit_lab/config.py) and prints it as a table; with --model, what each rank of N GPUs would hold
of that folder's model under each configuration, sharded or not (xdit_lab/plan/). `run` generates on
every rank torchrun starts (xdit_lab/run.py); `demo` spawns local ranks and draws the bundled model's ten digits (demo.py);
`compare` sets two runs of one prompts file side by side, image by image (compare.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

from .config import COMM_DTYPES, GRID, SCHEDULES, ParallelConfig, ParallelConfigError, _visible_gpus
from .distributed import env_world_size, usable_cpu_cores
from .launch import LAUNCHED, launch_ranks, say_once, under_torchrun
from .mesh import RankMesh
from .model_folder import transformer_heads
from .plan_table import format_plan, plan_legend, plan_table, why_lines, wrapped
from .quantization import SCHEMES


def _gpu_memory(text: str) -> int:
    """argparse type for --gpu-memory (plan.command.memory_size), imported when the option is given: plan/ pulls in
    diffusers, which `xdit-lab plan` without --model, `--help` and argument errors need not wait for."""
    from .plan.command import memory_size

    return memory_size(text)


def _count(minimum: int):
    """argparse type for a whole number >= minimum, with a message naming the bad value."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def _add_strategy_arguments(parser: argparse.ArgumentParser, *, degree_default: int | None) -> None:
    """The parallel strategy's arguments, the same for `run` and `demo`: each degree (named as
    ParallelConfig's fields), PipeFusion's patches and its synchronous warm-up steps."""
    for degree in GRID:
        default = "" if degree_default is None else f" (default {degree_default})"
        parser.add_argument(f"--{degree}", type=_count(1), default=degree_default, help=f"{degree} degree{default}")
    parser.add_argument("--num-patches", type=_count(1), help="PipeFusion patches (default: one per stage)")
    parser.add_argument("--warmup-steps", type=_count(0), default=1, help="PipeFusion synchronous steps (default 1)")


def _add_sampling_arguments(parser: argparse.ArgumentParser, *, steps_default: str) -> None:
    """Denoising steps (`steps_default`: where the default comes from) and the seed, for `run` and `demo`."""
    parser.add_argument("--steps", type=_count(1), help=f"denoising steps (default: {steps_default})")
    parser.add_argument("--seed", type=int, default=0)


def local_world_size() -> tuple[int, str]:
    """Ranks this machine can run, and why: its visible CUDA GPUs, else its usable CPU cores."""
    gpus = _visible_gpus()
    if gpus:
        return gpus, f"{gpus} visible CUDA GPU{'s' if gpus > 1 else ''}"
    cores = usable_cpu_cores()
    return cores, f"no CUDA GPU visible, so {cores} CPU core{'s' if cores > 1 else ''}"


def _shows_bytes(args) -> bool:
    return args.seq_len is not None and args.hidden_size is not None


# `plan`'s arguments that shape the cost model (plan_table takes them under these names); a model folder's
# configs say them, so `plan --model` refuses them
MODEL_SHAPE_ARGUMENTS = ("heads", "layers", "seq_len", "hidden_size")


def cmd_plan_model(args) -> int:
    """`plan --model`: what each rank would hold of a model folder under every configuration (plan/)."""
    import torch

    from .plan.command import print_plan

    given = [f"--{name.replace('_', '-')}" for name in MODEL_SHAPE_ARGUMENTS if getattr(args, name)]
    if given:
        raise ParallelConfigError(f"{', '.join(given)} cannot be given with --model: the folder's configs say them")
    if args.comm_dtype is not None:  # a memory plan: what travels on the links changes no rank's memory
        raise ParallelConfigError(
            "--comm-dtype weighs the links' bytes in the cost model's ranking (plan without --model); --model plans "
            "what each rank holds, which float8 on the links does not change: leave out one of them"
        )
    if args.no_tp:  # the folder's family says it: plan_model ranks tp rows only where the family has a tp plan
        raise ParallelConfigError(
            "--no-tp is for plan without --model; --model ranks tp only where the folder's family has a tp plan"
        )
    if args.gpu_memory is None:
        raise ParallelConfigError("--model needs --gpu-memory: the memory of one GPU, e.g. --gpu-memory 24GB")
    world_size = args.world_size if args.world_size is not None else local_world_size()[0]
    options = dict(height=args.height, width=args.width, batch=args.batch, use_cfg=False if args.no_cfg else None)
    options["quantize"] = args.quantize
    options["offload_blocks"] = args.offload_blocks
    return print_plan(
        args.model,
        world_size,
        args.gpu_memory,
        getattr(torch, args.dtype),
        args.json,
        args.top,
        options,
        wide=args.wide,
        why=args.why,
    )


def cmd_plan(args) -> int:
    if args.model is not None:
        return cmd_plan_model(args)
    modelled = (args.gpu_memory is not None, args.json, args.height, args.width, args.quantize, args.offload_blocks)
    if any(modelled) or args.wide:
        raise ParallelConfigError(
            "--gpu-memory, --json, --height, --width, --quantize, --offload-blocks and --wide plan a model: give "
            "--model FOLDER too"
        )
    if args.world_size is None:
        world_size, why = local_world_size()
        source = f"this machine: {why}"
    else:
        world_size, source = args.world_size, "--world-size"
    layers = args.layers if args.layers is not None else "28 (cost-model default)"
    shape = (
        f"heads {args.heads or 'any'}, layers {layers}, seq_len {args.seq_len or 'any'}, batch {args.batch}, "
        f"CFG {'off' if args.no_cfg else 'on'}, tp {'off (--no-tp)' if args.no_tp else 'on (a family with a tp plan)'}"
        + (f", {args.comm_dtype} on sp links" if args.comm_dtype else "")
    )
    print(wrapped(f"Parallel configurations for {world_size} ranks ({source}); {shape}"))
    shape_arguments = {name: getattr(args, name) for name in MODEL_SHAPE_ARGUMENTS}
    rows, configs = plan_table(
        world_size,
        **shape_arguments,
        batch=args.batch,
        use_cfg=not args.no_cfg,
        top=args.top,
        reasons=args.why,
        comm_dtype=args.comm_dtype,
        tensor_parallel=not args.no_tp,
    )
    # the reasons go under the table, a line each, which keeps it within WIDTH columns
    reasons = [row.pop() for row in rows] if args.why else []
    print(format_plan(rows))
    if len(configs) > len(rows) - 1:
        print(f"... {len(configs) - (len(rows) - 1)} more (--top 0 shows all {len(configs)})")
    print(plan_legend(_shows_bytes(args)))
    if args.why:
        print(why_lines([f"#{row[0]} {row[1]}" for row in rows[1:]], reasons[1:]))
    return 0


def _option(text: str) -> tuple[str, object]:
    """--option key=value, the value read as JSON when it parses (false, 8, 1.5), else as text."""
    import json

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


# --cache NAME[:KEY=VALUE,...]: diffusers' cache configurations by a short name
CACHE_NAMES = dict(
    fbc="FirstBlockCacheConfig",
    taylorseer="TaylorSeerCacheConfig",
    magcache="MagCacheConfig",
    pab="PyramidAttentionBroadcastConfig",
    fastercache="FasterCacheConfig",
    seacache="SeaCacheConfig",
    textkv="TextKVCacheConfig",
)


# --cache NAME[:KEY=VALUE,...]: ours, StepCache(method=...) by its method's short name
OURS = dict(stepcache="first_block", teacache="teacache", dbcache="dbcache")


def _cache(text: str):
    """--cache fbc:threshold=0.2, taylorseer:cache_interval=4, magcache:mag_ratios=[1.0,0.9,...]: one of diffusers'
    cache configurations, or stepcache:threshold=0.1, teacache:threshold=0.15,coefficients=[...],
    dbcache:threshold=0.1,front=2,back=1,taylor_order=1 (ours: StepCache(0.1), StepCache(method="teacache"),
    StepCache(method="dbcache")); each
    value read as JSON when it parses (a list for a range or the ratios), else as text (a dtype field's by its torch
    name: taylor_factors_dtype=float32)."""
    import dataclasses
    import functools
    import json
    import re

    import diffusers.hooks
    import torch

    name, _, settings = text.partition(":")
    if name not in (*CACHE_NAMES, *OURS):
        raise argparse.ArgumentTypeError(f"--cache {name!r}: name one of {', '.join((*CACHE_NAMES, *OURS))}")
    if name in OURS:  # ours: StepCache(threshold, method=..., ...), e.g. teacache:coefficients=[...], dbcache:front=2
        from .accelerations import StepCache

        kind = functools.partial(StepCache, method=OURS[name])
        defaults = {}
    else:
        kind = getattr(diffusers.hooks, CACHE_NAMES[name])
        defaults = {field.name: field.default for field in dataclasses.fields(kind)}
    values = {}
    for item in filter(None, re.split(r",(?![^\[]*\])", settings)):  # commas outside [...]
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"--cache {text!r}: expected NAME:KEY=VALUE,..., got {item!r}")
        try:
            values[key] = json.loads(value)
        except json.JSONDecodeError:
            values[key] = value
        if isinstance(defaults.get(key), torch.dtype):
            if not isinstance(getattr(torch, value, None), torch.dtype):
                raise argparse.ArgumentTypeError(f"--cache {text!r}: {key}={value!r} is no torch dtype (float32, ...)")
            values[key] = getattr(torch, value)
    try:
        return kind(**values)
    except (TypeError, ValueError) as error:
        raise argparse.ArgumentTypeError(f"--cache {text!r}: {error}") from None


def _lora(text: str) -> tuple:
    """--lora PATH[=SCALE][@transformer_2]: the adapter's path, its scale (1 when not given) and, for Wan 2.2 A14B's
    second expert, the transformer it goes into (load_pipeline's lora entries)."""
    into = "transformer_2" if text.endswith("@transformer_2") else None
    text = text.removesuffix("@transformer_2")
    path, sep, scale = text.rpartition("=")
    try:
        path, scale = (path, float(scale)) if sep else (text, 1.0)
    except ValueError:
        path, scale = text, 1.0  # an "=" that is part of the path
    return (path, scale) if into is None else (path, scale, into)


# `run`'s arguments that run_generation takes under the same names, as they are
RUN_ARGUMENTS_AS_NAMED = tuple("steps seed height width output_type".split())


def load_options_of(args):
    """`run`'s flags that say how the weights load, as load_pipeline's LoadOptions (a --cache as the StepCache or
    the diffusers cache configuration it names)."""
    from .load_options import LoadOptions

    return LoadOptions(
        torch_dtype=args.dtype,
        progress=not args.no_progress,
        cache=args.cache,
        compile=args.compile,
        shard_weights=args.shard_weights,
        on_host=tuple(args.on_host),
        offload_blocks=args.offload_blocks,
        quantization=args.quantization,
        lora=args.lora,
        pipeline_class=args.pipeline_class,
    )


def cmd_run(args) -> int:
    """`run` on this rank (under torchrun), or `--ranks N` local ranks started here (launch.py). An error is one
    line, said once however many ranks meet it (launch.say_once): exit 2 for the user's input, 1 for the run."""
    if args.ranks is not None and not os.environ.get(LAUNCHED):
        if under_torchrun():
            raise ParallelConfigError("--ranks starts the ranks itself: under torchrun, leave it out")
        return launch_ranks(args.ranks, args.argv)
    degrees = {degree: getattr(args, degree) for degree in GRID}
    config = ParallelConfig(
        **degrees,
        num_patches=args.num_patches,
        warmup_steps=args.warmup_steps,
        pipefusion_schedule=args.pipefusion_schedule,
        comm_dtype=args.comm_dtype,
    )
    try:  # before diffusers is imported: a wrong degree is said at once, with advice that fits the model's heads
        RankMesh.check(config, env_world_size(), num_heads=transformer_heads(args.model))
    except ValueError as error:  # ParallelConfigError, or a WORLD_SIZE that is not a number
        say_once(f"xdit-lab run: error: {error}")
        return 2
    negatives = args.negative_prompt
    if negatives and len(negatives) == 1:
        negatives = negatives[0]  # one negative prompt for every prompt
    if args.prompts is None and (args.images_per_prompt != 1 or args.batch_size is not None):
        raise ParallelConfigError("--images-per-prompt and --batch-size go with --prompts FILE")
    if args.prompts is not None and isinstance(negatives, list):
        raise ParallelConfigError("with --prompts, give one --negative-prompt for all, or each line's in a .jsonl file")
    from .distributed import shutdown_distributed
    from .pipeline import loading_bars_hidden
    from .plan import MemoryPlanError
    from .run import PeerTimeoutError, run_generation, run_prompts_file
    from .safetensors_io import CorruptWeightsError

    bars = loading_bars_hidden() if args.no_progress else contextlib.nullcontext()
    arguments = dict(
        guidance_scale=args.guidance,
        **{name: getattr(args, name) for name in RUN_ARGUMENTS_AS_NAMED},
        timeout_s=args.timeout,
        options=dict(args.option),
        image_files={
            k: v
            for k, v in dict(
                image=args.image,
                mask_image=args.mask_image and [args.mask_image],
                control_image=args.control_image and [args.control_image],
            ).items()
            if v
        },
    )
    try:
        arguments["load_options"] = load_options_of(args)  # here: a StepCache's threshold is checked as it is made
        with bars:
            if args.prompts is not None:
                report = run_prompts_file(
                    args.model,
                    args.prompts,
                    config,
                    args.output,
                    images_per_prompt=args.images_per_prompt,
                    batch_size=args.batch_size,
                    negative_prompt=negatives,
                    **arguments,
                )
            else:
                report = run_generation(
                    args.model, args.prompt, config, args.output, negative_prompts=negatives, **arguments
                )
    except (
        ParallelConfigError,
        ValueError,
        TypeError,
        FileNotFoundError,
        NotADirectoryError,
        MemoryPlanError,
        CorruptWeightsError,
    ) as error:  # the user's input (the folder, its files, the arguments): say what is wrong, no traceback
        say_once(f"xdit-lab run: error: {error}")
        return 2
    except (OSError, PeerTimeoutError) as error:  # the run: an output not written, a peer that never answered
        say_once(f"xdit-lab run: error: {error}")
        return 1
    finally:
        shutdown_distributed()
    if report is not None and args.prompts is not None:
        phases = ", ".join(f"{phase} {seconds:.2f} s" for phase, seconds in report["seconds_per_phase"].items())
        rate = report["images_per_second"]
        print(
            f"{report['pipeline']} under {report['config_short']}: drew {report['drawn']} of {report['images']} "
            f"images ({report['resumed_with']} were already in {args.output}), "
            + (f"{rate:.2f} images/s ({phases})" if rate else "nothing left to draw")
        )
        print(f"wrote the images, records.jsonl and report.json to {args.output}")
    elif report is not None:
        t = report["timings"]
        print(
            f"{report['pipeline']} under {report['config_short']}: encode {t['encode']:.2f} s, "
            f"denoise {t['denoise']:.2f} s ({len(t['steps'])} steps), decode {t['decode']:.2f} s"
        )
        cache = report["load_options"]["cache"]
        if cache is not None:
            skips = report["cache_skips"]
            method = "" if cache.get("method", "first_block") == "first_block" else f", method={cache['method']!r}"
            named = cache.get("diffusers") or f"StepCache({cache['threshold']}{method})"
            print(f"{named} skipped {sum(skips)} of {len(skips)} steps: {skips}")
        print(f"wrote {', '.join(report['outputs'])} and report.json to {args.output}")
    return 0


def cmd_demo(args) -> int:
    from .demo import config_from_args, print_report, run_demo

    try:
        report = run_demo(config_from_args(args), args.ranks, args.output, steps=args.steps, seed=args.seed)
    except (ValueError, FileNotFoundError) as error:
        print(f"xdit-lab demo: error: {error}", file=sys.stderr)
        return 2
    print_report(report)
    return 0


def cmd_compare(args) -> int:
    from .compare import CompareError, compare_runs, format_summary, write_comparison

    try:
        comparison = compare_runs(args.run_a, args.run_b)
        written = write_comparison(comparison, args.output or f"{args.run_b}/compare")
    except (CompareError, FileNotFoundError) as error:
        print(f"xdit-lab compare: error: {error}", file=sys.stderr)
        return 2
    print(format_summary(comparison["summary"]))
    print(f"wrote compare.json (every image) and compare.png (the distributions) to {written}")
    return 0


def _subcommand(commands, handler, summary: str, description: str) -> argparse.ArgumentParser:
    """The parser of the subcommand `handler` runs, named after it (cmd_run: `run`)."""
    parser = commands.add_parser(handler.__name__.removeprefix("cmd_"), help=summary, description=description)
    parser.set_defaults(handler=handler)
    return parser


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="xdit-lab", description="Hybrid-parallel inference of Diffusion Transformers.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    plan = _subcommand(
        commands,
        cmd_plan,
        "rank the parallel configurations that fit N ranks",
        "Rank every valid ParallelConfig for N ranks with the cost model.",
    )
    plan.add_argument(
        "--world-size", type=_count(1), metavar="N", help="number of ranks (default: visible CUDA GPUs, else CPU cores)"
    )
    plan.add_argument("--heads", type=_count(1), metavar="H", help="attention heads (Ulysses up to this many ranks)")
    plan.add_argument("--layers", type=_count(1), metavar="L", help="transformer layers (default 28 for costs)")
    plan.add_argument("--seq-len", type=_count(1), metavar="S", help="image tokens per image (p)")
    plan.add_argument("--hidden-size", type=_count(1), metavar="HS", help="hidden size; with --seq-len, shows bytes")
    plan.add_argument("--batch", type=_count(1), default=1, metavar="B", help="prompts per step (default 1)")
    plan.add_argument("--no-cfg", action="store_true", help="no classifier-free guidance (one branch, no cfg 2)")
    plan.add_argument(
        "--no-tp",
        action="store_true",
        help="no tensor parallelism: for a model whose family has no tp plan (--model knows which: it ranks tp "
        "only where the family has one)",
    )
    plan.add_argument("--top", type=_count(0), default=10, metavar="K", help="rows to show (default 10; 0: all)")
    plan.add_argument("--why", action="store_true", help="say why each configuration ranks above the next")
    plan.add_argument(
        "--comm-dtype",
        choices=COMM_DTYPES,
        help="float8 on Ulysses' and Ring's links (a float32 scale per token and head): about half of bfloat16's "
        "bytes, an approximation; configurations that cannot carry it (PipeFusion with ulysses or ring) keep "
        "the model's dtype (default: the model's dtype, exact)",
    )
    plan.add_argument(
        "--wide",
        action="store_true",
        help="with --model: every term a rank holds, a column each (the default table keeps to 100 columns)",
    )
    plan.add_argument("--model", metavar="FOLDER", help="a diffusers folder: plan what each rank holds of it")
    plan.add_argument(
        "--gpu-memory", type=_gpu_memory, metavar="SIZE", help="with --model: one GPU's memory (24GB, 22.5GiB, bytes)"
    )
    plan.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16", help="with --model")
    plan.add_argument(
        "--quantize",
        choices=list(SCHEMES),
        help="with --model: the transformer's and text encoders' linear weights in this torchao weight-only scheme",
    )
    plan.add_argument(
        "--offload-blocks",
        type=_count(1),
        metavar="N",
        help="with --model: the transformer's blocks in host memory, N at a time on the GPU (run's --offload-blocks): "
        "each row counts N blocks and the root, and the bytes moved from the host per step",
    )
    plan.add_argument("--height", type=_count(1), help="with --model: the image height (default: the model's)")
    plan.add_argument("--width", type=_count(1), help="with --model: the image width (default: the model's)")
    plan.add_argument("--json", action="store_true", help="with --model: print the rows as a JSON list")

    run = _subcommand(
        commands,
        cmd_run,
        "generate with a pipeline folder (launch with torchrun)",
        "Generate images on every rank that torchrun starts; the first rank writes the images and report.json.",
    )
    run.add_argument(
        "--ranks",
        type=_count(1),
        metavar="N",
        help="start N local ranks (torch's torchrun machinery, run here); leave it out under torchrun",
    )
    run.add_argument("--model", required=True, help="a diffusers pipeline folder, or a bundled name (digits)")
    given = run.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", action="append", help="a prompt; repeat for a batch")
    given.add_argument(
        "--prompts",
        metavar="FILE",
        help="a prompts file: one prompt per line, or JSON lines (.jsonl) with prompt and optionally negative_prompt, "
        "seed and id; drawn --batch-size at a time, each image written and recorded (records.jsonl) as it is made, "
        "and a rerun into the same --output resumes (xdit_lab/prompts_file.py)",
    )
    run.add_argument("--images-per-prompt", type=_count(1), default=1, help="with --prompts: images per prompt")
    run.add_argument("--batch-size", type=_count(1), help="with --prompts: images per call (default: the dp degree)")
    run.add_argument(
        "--negative-prompt", action="append", help="one per --prompt, or one for all (with --prompts: one for all)"
    )
    _add_strategy_arguments(run, degree_default=1)
    run.add_argument(
        "--pipefusion-schedule",
        choices=SCHEDULES,
        default="drained",
        help="drained: every step empties the pipeline; async: the next step's patches start while the last "
        "stage finishes (README: PipeFusion's schedules)",
    )
    run.add_argument(
        "--comm-dtype",
        choices=COMM_DTYPES,
        help="float8 on Ulysses' and Ring's links, a float32 scale per token and head: about half of bfloat16's "
        "bytes, an approximation (not with PipeFusion and ulysses or ring; default: the model's dtype, exact)",
    )
    _add_sampling_arguments(run, steps_default="the family's")
    run.add_argument("--guidance", type=float, help="guidance scale (default: the family's)")
    run.add_argument("--height", type=_count(1))
    run.add_argument("--width", type=_count(1))
    run.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="auto (default): bfloat16 on a GPU, float32 on a CPU",
    )
    run.add_argument("--output", required=True, help="folder for the images and report.json")
    run.add_argument(
        "--output-type",
        choices=["pil", "latent"],
        default="pil",
        help="latent: skip the VAE and save latents.pt (for timing the transformer alone)",
    )
    run.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a pipeline argument of the family, e.g. use_resolution_binning=false",
    )
    run.add_argument(
        "--cache",
        type=_cache,
        metavar="NAME:KEY=VALUE,...",
        help="a cache, one decision for every rank: ours, First-Block Cache as StepCache(0.1) "
        "(stepcache:threshold=0.1; PipeFusion takes it too); or one of diffusers' cache configurations, run "
        "by its own hooks: fbc:threshold=0.2, taylorseer:cache_interval=4, magcache:mag_ratios=[...], "
        "pab:spatial_attention_block_skip_range=2 (each key a field of its diffusers config); or TeaCache, ours "
        "(StepCache(method='teacache'); Flux, Flux.2, Wan, HunyuanVideo, Qwen-Image, CogVideoX, PixArt): "
        "teacache:threshold=0.15,coefficients=[...]; or DBCache, ours (StepCache(method='dbcache')): "
        "dbcache:threshold=0.1,front=2,back=1,taylor_order=1. Default: no cache",
    )
    run.add_argument(
        "--compile",
        action="store_true",
        help="compile the transformer whole with torch.compile (not with PipeFusion; with a cache, a graph per decision); "
        "the first step pays for the compile, see timings",
    )
    run.add_argument(
        "--shard-weights",
        action="store_true",
        help="shard the transformer's weights over the ranks that hold the same ones, and the text encoders' over "
        "all ranks (torch FSDP2): each rank holds 1/N and gathers a block as it runs; see xdit-lab plan --model",
    )
    run.add_argument(
        "--on-host",
        action="append",
        default=[],
        metavar="COMPONENT",
        help="keep this text encoder (e.g. text_encoder_2) in host memory and run it there; repeat for more",
    )
    run.add_argument(
        "--offload-blocks",
        type=_count(1),
        metavar="N",
        help="keep the transformer's weights in host memory and bring its blocks to the GPU N at a time as they run "
        "(diffusers' group offloading; a PipeFusion stage offloads its own blocks): a GPU holds N blocks and the "
        "rest of the model, and every weight crosses from the host each step; not with --shard-weights or "
        "--compile; see xdit-lab plan --model --offload-blocks N",
    )
    run.add_argument(
        "--quantize",
        dest="quantization",
        choices=list(SCHEMES),
        help="load the transformer's and text encoders' linear weights in this torchao weight-only scheme, block "
        "by block as they are read (int8: 1 byte per weight and a scale per row); not with --shard-weights",
    )
    run.add_argument(
        "--lora",
        type=_lora,
        action="append",
        metavar="PATH[=SCALE]",
        help="a LoRA adapter (file or folder) fused into the weights before parallelizing, at SCALE (default 1); "
        "repeat for more; PATH=SCALE@transformer_2 puts it into Wan 2.2 A14B's second (low-noise) expert",
    )
    run.add_argument(
        "--pipeline-class",
        metavar="NAME",
        help="run the folder as another diffusers pipeline of its family, e.g. FluxImg2ImgPipeline, "
        "FluxInpaintPipeline or FluxKontextPipeline (README: Starting from an image)",
    )
    run.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="the image the pipeline starts from (with --pipeline-class); repeat for several (Flux.2's references)",
    )
    run.add_argument("--mask-image", metavar="FILE", help="inpainting's mask: white is redrawn, black kept")
    run.add_argument(
        "--control-image",
        metavar="FILE",
        help="a ControlNet's control image (FluxControlNetPipeline; its scale: --option controlnet_conditioning_scale=0.7)",
    )
    run.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait (default 600)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")

    demo = _subcommand(
        commands,
        cmd_demo,
        "draw the ten digits with the bundled model under a parallel strategy",
        "Spawn local ranks (CPU) or use the visible GPUs, draw the digits 0-9 with the bundled model, and write a "
        "grid PNG and a per-rank report.",
    )
    demo.add_argument("--ranks", type=_count(1), help="processes to start (default: the strategy's, or 2 on CPU)")
    _add_strategy_arguments(demo, degree_default=None)  # none given: the cost model's best for the ranks
    _add_sampling_arguments(demo, steps_default="the model card's")
    demo.add_argument("--output", default="outputs/demo", help="folder for the grid, images and report.json")

    compare = _subcommand(
        commands,
        cmd_compare,
        "compare two runs of one prompts file image by image (PSNR, SSIM, largest difference)",
        "Match the images of two `xdit-lab run --prompts` folders by id; write each pair's PSNR, SSIM and largest "
        "difference, a summary and a plot of their distributions (and, for the digits model, each run's accuracy).",
    )
    compare.add_argument("run_a", help="the reference run's folder (e.g. the serial run)")
    compare.add_argument("run_b", help="the run compared with it")
    compare.add_argument("--output", help="folder for compare.json and compare.png (default: RUN_B/compare)")
    return parser


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors are said once however many ranks parse the same arguments."""

    def error(self, message):
        say_once(f"{self.format_usage()}{self.prog}: error: {message}")
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)  # bad arguments: argparse prints usage + message (once), exits 2
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what `run --ranks N` hands its ranks
    try:
        return args.handler(args)
    except ParallelConfigError as error:  # a rule the arguments break: say it, no traceback
        say_once(f"xdit-lab {args.command}: error: {error}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
