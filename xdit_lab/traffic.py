"""The exact traffic model: the bytes one rank sends in one denoising step, per group, in closed form.

The twin of the cost model (config.py), which ranks configurations in units of p·hs per image: this one
counts exact bytes for one rank of a run, from the sizes the run had (a rank summary's `shapes`:
batch rows, token grid, heads, head_dim, text length, attention layers by kind, dtype), so that a view or a
test can put the formula beside what comm_log() measured, rank by rank and step by step.
"""

from __future__ import annotations

from .accelerations import DECIDED_ALIKE
from .config import SCALE_BYTES, ParallelConfig, tp_bytes_per_forward
from .mesh import CFG, DP, PIPEFUSION, RING, SP, TP, ULYSSES, WORLD
from .sharding import patch_layout, shard_sizes


def expected_bytes_per_step(
    config,
    shapes: dict | None = None,
    *,
    coords: dict | None = None,
    step: int | None = None,
    cache_skips: list[bool] | None = None,
    experts: list[int] | None = None,
    cache_method: str | None = None,
) -> dict[str, int]:
    """Bytes out of one rank in one denoising step, per group, as the closed forms give them.

    Pass a rank summary (its last step by default), or a ParallelConfig (or its fields), the
    summary's `shapes`, the rank's `coords` and the step index. With b = this rank's batch rows,
    h = heads, h_me = the heads this rank attends under Ulysses (h/N, or its tensor_split share where N
    does not divide h: attention/ulysses.py), d = head_dim, e = bytes per element, per sequence-parallel
    attention layer:
      ulysses     2 all-to-alls: q, k, v together send 3·b·(h - h_me)·S_me·d; o sends b·h_me·(S_group - S_me)·d
                  (= 4·(N-1)/N of the local q, k, v, o for even shards and heads). Joint text, sequence shards:
                  each rank's text shard T_me travels beside its image shard (S_me + T_me tokens above, in joint
                  layers); whole on every rank (PipeFusion, or `text_sharded=False`): in o's, b·h_me·T·d
                  to each peer
      ring        N-1 sends of the K/V block held [2, b, h_me, block, d], a block holding its ranks'
                  text shards in joint layers; text whole on every rank: a float32 gather of the text
                  partials with their LSE [b, h_me, T, d+1] instead
      comm_dtype  float8 on the ulysses and ring exchanges above (config.comm_dtype): every row of d elements
                  travels as d + 4 bytes (its float8 bytes and a float32 scale) instead of d·e; the text
                  partials stay float32
      sp          the token gather before unpatchify, padded to the longest shard (a model that pads the image's
                  tokens itself, `padded_tokens`: Z-Image's to a multiple of 32, shards and gathers them too)
      linear      a linear-attention layer (Sana's, `linear_layers`) all-reduces its sums [b, h, d+1, d] in float32,
                  over the ulysses group, then the ring group: 2·(N-1)/N of them out of a rank per group (floored
                  per call); no token moves
      halo        a convolution over token rows (`row_conv_layers`, `halo_rows` rows of reach) sends its band's
                  edge rows to each sp neighbour: b·halo_rows·cols·h·d a neighbour, under "sp"
      pipefusion  per patch (its row band of the grid and of each image after it, `appended_grids`: an edit's
                  reference images; the last with the model's padding, Z-Image's) a non-last stage sends
                  [b, tokens, hidden], and [b, T, hidden] of text states where its blocks return them (SD3,
                  Flux, CogVideoX, Z-Image's main layers), or in their place the `handed_beside` elements a
                  row of the stream its blocks carry beside the image's (LTX-2's audio); the last stage
                  broadcasts the noise prediction [b, sample] (and the outputs beside it, `also_gathered`)
                  to the other stages; async, past the
                  warmup, it sends the whole latents back to stage 0 instead (a patch at a time), and
                  after the last step broadcasts them, and the dp and cfg gathers run once per patch
                  on the last stage only
      whole q     a layer whose queries are whole on every rank against the image's keys (`whole_query_rows`: LTX-2's
                  audio asking the video) all-gathers each rank's partial output with its LSE in float32:
                  b·whole_query_rows·4 bytes to each of the sp-1 others, under "sp", in every forward (every
                  patch set's under PipeFusion)
      tp          a model split over tp ranks (`shapes["tp"]`: models/tensor_parallel.tp_shapes): each forward's
                  all-reduces and gathers, tp_bytes_per_forward (config.py: the cost model's tp term too), over
                  this rank's tokens (its sequence shard's, the text's shard where it is cut, the whole text in a
                  refiner before the blocks; under PipeFusion each patch set's, the layers after the blocks on the
                  last stage alone); the attention exchanges above then move the h/tp heads of this rank, and a
                  stage hands on its patches whole (after the all-reduce) to the next stage's rank of the same tp
                  coordinate
      dp, cfg     the output gather (dp pads to the largest share), with the outputs gathered beside the sample
                  (`also_gathered` elements a sample: LTX-2's audio)
      controlnet  a ControlNet's layers (`controlnet_self_layers`, `controlnet_joint_layers`) move what the
                  transformer's do: the same tokens, text and heads; its residuals stay on their rank
      world       with a StepCache (`cache_skips`: one bool per step), from the second step on the
                  decision's all-reduce of two float32; at a skipped step only the first block's
                  attention layers run (on PipeFusion's first stage). With two transformers
                  (`experts`: which one ran each step) each keeps its own state, so the
                  all-reduce runs from each one's second step on. diffusers' FirstBlockCacheConfig
                  (`cache_method`) moves the same; its TaylorSeer, MagCache, PyramidAttentionBroadcast and
                  FasterCache decide from the schedule and its SeaCache from the transformer's whole input, which every
                  rank holds (nothing moves for it), and at a step they skip no attention
                  layer runs (their hooks cover every block or attention layer of the families they run on).
                  StepCache(method="teacache") (`cache_method` "StepCache(teacache)") moves StepCache's all-reduce
                  and at a step it skips no attention layer runs; StepCache(method="dbcache") moves the same
                  all-reduce, and at a step it skips its front and back blocks' attention layers run (the
                  `first_block_*` counts are a skipped step's blocks: models/cache.kept_block_names)
    Under PipeFusion attention runs once per patch set (all patches in warmup steps, one patch
    at a time after), its queries are that set's tokens and Ring passes the whole stale buffer; the
    joint text stays whole on every rank there. `shapes["text_sharded"]` says whether sequence shards
    split the joint text (True by default without PipeFusion; the control keeps it whole; a text of
    fewer tokens than sp ranks stays whole).
    Exact for the code as written (checked in tests/test_lab_views.py); one dtype is assumed for
    activations, noise and output (the session runs in one dtype)."""
    if isinstance(config, dict) and "shapes" in config:  # a rank summary
        summary = config
        config, shapes, coords = summary["config"], summary["shapes"], summary["coords"]
        step = summary["step"] - 1 if step is None else step
        cache_skips = summary["cache"]["skips"] if summary.get("cache") else None
        cache_method = summary["cache"].get("method") if summary.get("cache") else None
        experts = summary.get("experts")
    if isinstance(config, dict):
        config = ParallelConfig(**config)
    c, s, e = config, shapes, shapes["dtype_bytes"]
    step = 0 if step is None else step
    u, r, sp = c.ulysses, c.ring, c.sp_degree
    my_u, my_r = coords[ULYSSES], coords[RING]
    sp_rank = my_r * u + my_u
    per_branch = s["batch"] // c.cfg
    dp_sizes = shard_sizes(per_branch, c.dp)
    b = max(dp_sizes[coords[DP]], 1)  # a dp group without samples computes one stand-in
    # the image tokens: the grid's, and those after it (an edit's reference image, `appended_tokens`); the model
    # shards and gathers its padding with them too (`padded_tokens`, Z-Image's), which its output drops
    tokens = s["rows"] * s["cols"] + s.get("appended_tokens", 0)
    sharded = tokens + s.get("padded_tokens", 0)
    h, d, text = s["heads"] // c.tp, s["head_dim"], s["text_len"]  # the heads of this rank's tp share
    h_me = shard_sizes(h, u)[my_u]  # the heads this rank attends after the Ulysses all-to-all
    sample = tokens * s["proj_width"]  # elements of one sample of the output (unpatchify keeps the count)
    last_stage = coords[PIPEFUSION] == c.pipefusion - 1

    experts = experts if experts is not None and len(experts) > step else [0] * (step + 1)  # one transformer
    # a PipeFusion stage counts its steps from when its transformer took over (another expert's stale K/V is
    # freed at a switch: each expert warms up anew)
    stage_step = next((step - i for i in range(step, -1, -1) if experts[i] != experts[step]), step + 1) - 1
    if c.pipefusion > 1:
        # patch i: row band i of the drawn grid and of each image after it (an edit's references, `appended_grids`)
        appended = tuple(tuple(grid) for grid in s.get("appended_grids", ()))
        layout = patch_layout((s["rows"], s["cols"]), c.patches, sp, appended, padded=s.get("padded_tokens", 0))
        warm = stage_step < c.warmup_steps
        patch_sets = [list(range(c.patches))] if warm else [[p] for p in range(c.patches)]
        forwards = [layout.rank_sizes(active) for active in patch_sets]
        kv_sizes = layout.rank_sizes(list(range(c.patches)))  # the buffer: every patch
    else:  # one forward over this rank's shard; Ring passes the shards themselves
        forwards = [shard_sizes(sharded, sp)]
        kv_sizes = forwards[0]
    skipped = bool(cache_skips and cache_skips[step])
    by_schedule = cache_method in DECIDED_ALIKE  # a skipped step runs no attention layer, and nothing is agreed
    every_block = by_schedule or cache_method == "StepCache(teacache)"  # ... or it is agreed, and none runs
    # a ControlNet's layers run beside the transformer's, at a step a StepCache skips too (its residuals are fresh)
    self_layers = s["first_block_self_layers"] if skipped else s["self_layers"]
    joint_layers = s["first_block_joint_layers"] if skipped else s["joint_layers"]
    if skipped and every_block:
        self_layers = joint_layers = 0
    self_layers += s.get("controlnet_self_layers", 0)
    joint_layers += s.get("controlnet_joint_layers", 0)
    joint = joint_layers if text else 0
    # sequence shards split the joint text like the image (sp-rank order); PipeFusion keeps it whole
    text_sharded = bool(text >= sp and joint and s.get("text_sharded", c.pipefusion == 1))
    text_sizes = shard_sizes(text, sp) if text_sharded else [0] * sp

    # bytes of a run of elements on the attention exchanges: whole rows of d, each d + 4 bytes under float8
    row_bytes = d * e if c.comm_dtype is None else d + SCALE_BYTES
    out = dict.fromkeys((ULYSSES, RING, SP, PIPEFUSION, DP, CFG, WORLD, TP), 0)
    if cache_skips is not None and not by_schedule and experts[step] in experts[:step] and c.world_size > 1:
        out[WORLD] = 2 * 2 * 4 * (c.world_size - 1) // c.world_size
    for sizes in forwards:  # sizes: every sp rank's query tokens in this forward
        mine = slice(my_r * u, (my_r + 1) * u)
        if c.tp > 1:
            my_text = text_sizes[sp_rank] if text_sharded else text
            tokens_of = dict(image=sizes[sp_rank], text=my_text, joint=sizes[sp_rank] + my_text, whole_text=text)
            tokens_of["cross_text"] = s.get("cross_text_len", 0)
            split = s["tp"]

            def runs(always, after):  # at this step (a StepCache's skip), on this stage (the last runs the output)
                return (always or not skipped) and (last_stage or not after)

            out[TP] += tp_bytes_per_forward(
                c.tp,
                e,
                reduced=[b * tokens_of[kind] * width for kind, width, *when in split["rowwise"] if runs(*when)],
                gathered=[b * width for width, *when in split["gathered"] if runs(*when)],
                norm_rows=[b * tokens_of[kind] for kind, *when in split["norms"] if runs(*when)],
            )
        with_text = [n + t for n, t in zip(sizes, text_sizes)]  # a joint layer's tokens per sp rank
        if u > 1:

            def all_to_alls(group, me):  # q, k, v: this rank's tokens, other heads; o: the others' tokens, own heads
                return 3 * b * (h - h_me) * me + b * h_me * (sum(group) - me)  # rows of d

            out[ULYSSES] += (
                self_layers * all_to_alls(sizes[mine], sizes[mine][my_u])
                + joint_layers * all_to_alls(with_text[mine], with_text[mine][my_u])
            ) * row_bytes
            if not text_sharded:  # the text output, whole, in o's all-to-all to every peer
                out[ULYSSES] += joint * b * h_me * text * (u - 1) * row_bytes
        if r > 1:

            def held(tokens):  # the blocks held at each of the N-1 sends
                blocks = [sum(tokens[i * u : (i + 1) * u]) for i in range(r)]
                return sum(blocks[(my_r - k) % r] for k in range(r - 1))

            kv_with_text = [n + t for n, t in zip(kv_sizes, text_sizes)]
            out[RING] += 2 * b * h_me * row_bytes * (self_layers * held(kv_sizes) + joint_layers * held(kv_with_text))
            if not text_sharded:  # the text partials with their LSE, gathered in float32
                out[RING] += joint * (r - 1) * b * h_me * text * (d + 1) * 4
        if c.pipefusion > 1 and not last_stage:
            # this patch's tokens, and the text (or the stream beside the image's, LTX-2's audio, in its place)
            beside = s.get("handed_beside", 0) or (text * s["heads"] * d if s.get("handed_text") else 0)
            out[PIPEFUSION] += b * (sizes[sp_rank] * s["heads"] * d + beside) * e
        elif sp > 1:
            out[SP] += b * max(sizes) * s["proj_width"] * e * (sp - 1)
        if sp > 1:  # whole queries' partials, gathered in every forward (PipeFusion: every patch set's)
            out[SP] += b * s.get("whole_query_rows", 0) * 4 * (sp - 1)
    if c.pipefusion == 1:  # a PipeFusion stage holds whole patches (no sequence shards in it): these move nothing
        sums = b * s["heads"] * (d + 1) * d * 4  # float32
        for group, n in ((ULYSSES, u), (RING, r)):
            if n > 1:
                out[group] += s.get("linear_layers", 0) * (2 * sums * (n - 1) // n)
        if sp > 1:
            neighbours = (sp_rank > 0) + (sp_rank < sp - 1)
            halo = b * s.get("halo_rows", 0) * s["cols"] * h * d * e
            out[SP] += s.get("row_conv_layers", 0) * neighbours * halo
    pipelined = c.pipefusion_schedule == "async" and stage_step >= c.warmup_steps
    latents = s.get("latent_rows", 0) * s.get("latent_elements", 0) * s.get("latent_bytes", 0)
    if pipelined and last_stage:  # the latents back to stage 0, patch by patch; after the last step, to all
        out[PIPEFUSION] += latents * (c.pipefusion - 1 if step == s["steps"] - 1 else 1)
    sample += s.get("also_gathered", 0)  # the outputs beside the sample (LTX-2's audio), broadcast and gathered
    if c.pipefusion > 1 and last_stage and not pipelined:
        out[PIPEFUSION] += b * sample * e * (c.pipefusion - 1)
    # the batch gathers: once a step; pipelined, once per patch and only where the prediction is
    gathers = (c.patches if last_stage else 0) if pipelined else 1
    if c.dp > 1:
        out[DP] += gathers * max(dp_sizes) * sample * e * (c.dp - 1)
    if c.cfg > 1:
        out[CFG] += gathers * per_branch * sample * e * (c.cfg - 1)
    return {group: n for group, n in out.items() if n}
