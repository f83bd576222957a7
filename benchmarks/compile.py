"""torch.compile against eager, side by side in one run: every family's transformer, serial and
parallel, with inductor.

    python benchmarks/compile.py                               # 5 families, 1024 and 4096 tokens, 2 ranks
    python benchmarks/compile.py --tokens 4096 --families flux pixart --repeats 7 --markdown t.md

Each family's transformer is built at 8 heads x 64, 3 blocks (Flux: one double-stream block and two
single-stream ones; PixArt and Flux are peers.py's models), with 64 text tokens. Methods, in one
run and interleaved (A, B, C, D, A, B, ...):
  serial          diffusers' model, eager, on rank 0 alone (the other ranks wait)
  serial compiled torch.compile(model), the same
  ours <config>   parallelize(model, config), eager
  ours compiled   parallelize(model, config, compile=True)
Each figure is the median over repeats of the slowest rank, with the spread; the compile itself
is paid in a warm-up call before timing, and its seconds are reported apart. Every rank runs one
thread: with fewer cores than ranks, ranks compete for cores, so read the compiled / eager ratio
of a method, not speed-ups across rank counts. Also reported: each output's largest error against
serial eager (relative to its largest magnitude).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import HEAD_DIM, HEADS, TEXT_TOKENS, build_inputs, build_model, merge_ranks, write_whole  # noqa: E402

from xdit_lab import ParallelConfig, RankMesh, parallelize  # noqa: E402
from xdit_lab.tiny import tiny_inputs, tiny_transformer  # noqa: E402

FAMILIES = ["flux", "pixart", "sd3", "cogvideox", "dit"]
BLOCKS = 3


def model_and_inputs(family: str, tokens: int):
    """A family's transformer at the benchmark's size, and one input of `tokens` image tokens."""
    if family in ("flux", "pixart"):
        return build_model(family), build_inputs(family, tokens)
    inner = HEADS * HEAD_DIM
    common = dict(heads=HEADS, layers=BLOCKS, attention_head_dim=HEAD_DIM)
    frames = 4 if family == "cogvideox" else 1  # latent frames (CogVideoX compresses 13 frames to 4)
    side = 2 * round((tokens // frames) ** 0.5)  # latent pixels; each token is 2 x 2 of them
    if (side // 2) ** 2 * frames != tokens:
        raise ValueError(f"{tokens} image tokens do not make a square latent for {family}; use e.g. 1024 or 4096")
    if family == "sd3":
        model = tiny_transformer("sd3", **common, caption_projection_dim=inner, pos_embed_max_size=side)
    elif family == "cogvideox":
        model = tiny_transformer(
            "cogvideox", **common, sample_height=side, sample_width=side, sample_frames=13, max_text_seq_length=64
        )
    else:
        model = tiny_transformer("dit", **common, sample_size=side)
    inputs = tiny_inputs(family, 1, height=side, width=side, text_len=TEXT_TOKENS)
    if family == "cogvideox":
        inputs["hidden_states"] = inputs["hidden_states"][:, :1].expand(1, frames, -1, -1, -1).contiguous()
    return model, dict(inputs, return_dict=False)


def forward(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def bench(family: str, tokens_list: list[int], config: ParallelConfig, repeats: int) -> list[dict]:
    """Runs on every rank; returns this rank's rows (one per method and size)."""
    torch.set_num_threads(1)
    rank, mesh = dist.get_rank(), RankMesh(config)
    rows = []
    for tokens in tokens_list:
        torch._dynamo.reset()  # each size compiles afresh, with static shapes
        model, inputs = model_and_inputs(family, tokens)
        methods = {  # name: (callable, runs on every rank)
            "serial": (model, False),
            "serial compiled": (torch.compile(copy.deepcopy(model)), False),
            f"ours {config.short()}": (parallelize(copy.deepcopy(model), config, mesh), True),
            f"ours {config.short()} compiled": (parallelize(copy.deepcopy(model), config, mesh, compile=True), True),
        }
        outputs, compile_s = {}, {}
        for name, (m, everyone) in methods.items():  # warm-up; pays the compile
            if everyone or rank == 0:
                start = time.perf_counter()
                outputs[name] = forward(m, inputs)
                compile_s[name] = time.perf_counter() - start
        times = {name: [] for name in methods}
        for _ in range(repeats):
            for name, (m, everyone) in methods.items():
                dist.barrier()
                if everyone or rank == 0:
                    start = time.perf_counter()
                    forward(m, inputs)
                    times[name].append((time.perf_counter() - start) * 1e3)
                else:
                    times[name].append(0.0)  # the slowest rank's time is taken: rank 0's
        reference = outputs.get("serial")
        for name in methods:
            error = None
            if reference is not None:
                error = ((outputs[name] - reference).abs().max() / reference.abs().max()).item()
            rows.append(
                dict(family=family, tokens=tokens, ranks=dist.get_world_size(), method=name, ms=times[name])
                | dict(first_call_s=compile_s.get(name, 0.0), max_rel_error=error)
            )
    return rows


COLUMNS = ("model", "tokens", "method", "median ms", "spread ms", "eager / this", "first call s", "max rel err")


def table_rows(rows) -> list[tuple]:
    medians = {(r["family"], r["tokens"], r["method"]): statistics.median(r["ms"]) for r in rows}
    out = []
    for r in rows:
        med = medians[(r["family"], r["tokens"], r["method"])]
        eager = medians[(r["family"], r["tokens"], r["method"].removesuffix(" compiled"))]
        out.append(
            (r["family"], str(r["tokens"]), r["method"], f"{med:.1f}", f"{min(r['ms']):.0f}-{max(r['ms']):.0f}")
            + (f"{eager / med:.2f}", f"{r['first_call_s']:.1f}", f"{r['max_rel_error']:.1e}")
        )
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--families", nargs="+", default=FAMILIES, choices=FAMILIES)
    parser.add_argument("--ulysses", type=int, default=2, help="ulysses degree of ours (default 2)")
    parser.add_argument("--ring", type=int, default=1, help="ring degree of ours (default 1)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    args = parser.parse_args()
    from xdit_lab.testing import run_on_ranks

    config = ParallelConfig(ulysses=args.ulysses, ring=args.ring)
    rows = []
    for family in args.families:
        rows += merge_ranks(
            run_on_ranks(bench, config.world_size, family, args.tokens, config, args.repeats, timeout_s=7200)
        )
    body = table_rows(rows)
    widths = [max(len(c), *(len(r[i]) for r in body)) for i, c in enumerate(COLUMNS)]
    for line in [COLUMNS, *body]:
        print("  ".join(cell.rjust(w) for cell, w in zip(line, widths)).rstrip(), flush=True)
    if args.markdown:
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
        write_whole(args.markdown, "\n".join(lines + ["| " + " | ".join(r) + " |" for r in body]))


if __name__ == "__main__":
    main()
