"""diffusers' own DiT families under USP, CFG and data parallel, against their serial forward.

Each rank builds the same tiny model (same seed), runs the unwrapped model serially for the
reference, then parallelizes that same model (no weight copy) and compares the full output:
max abs error <= 1e-4 · max(1, max |reference|) in float32."""

import pytest
import torch
from forward_traffic import sample

from xdit_lab import ParallelConfig, ParallelConfigError, RankMesh, comm_log, parallelize
from xdit_lab.families import check_diffusers_version
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import tiny_inputs, tiny_transformer

FAMILIES = [
    "pixart", "sd3", "flux", "flux2", "qwenimage", "hunyuanvideo", "cogvideox", "wan", "dit", "zimage", "sana",
    "hunyuanvideo15", "ltx2",  # LTX-2: the video compared here; its audio too in tests/test_ltx2.py
]  # fmt: skip
# the control of families with padded text: the forward argument that masks it, and "nothing padded"
UNMASKED = {
    "qwenimage": ("encoder_hidden_states_mask", None),
    "hunyuanvideo": ("encoder_attention_mask", "ones"),
    "hunyuanvideo15": ("encoder_attention_mask", "ones"),
}
CASES = [  # (name, latent height, width, text length, batch)
    ("even", 8, 8, 8, 4),
    ("uneven-image", 6, 6, 8, 6),  # 9 patches (27 for CogVideoX): uneven over 2 and 4 ranks; dp gets 2 + 1
    ("uneven-text", 8, 8, 7, 4),
]
# families that convolve over token rows (Sana) need whole rows per shard: their uneven image is 4 rows of 6
WHOLE_ROWS_CASES = {"uneven-image": ("uneven-image", 4, 6, 8, 6)}
CONFIGS = {
    2: [ParallelConfig(ulysses=2), ParallelConfig(ring=2)],
    4: [
        ParallelConfig(ulysses=2, ring=2),
        ParallelConfig(cfg=2, ulysses=2),
        ParallelConfig(dp=2, ring=2),
        ParallelConfig(cfg=2, dp=2),
    ],
}


def _model(family, text_len):
    extra = {"max_text_seq_length": text_len} if family == "cogvideox" else {}
    return tiny_transformer(family, seed=0, **extra)


def _compare(family, configs):
    rows = []
    for config in configs:
        mesh = RankMesh(config)
        cases = [WHOLE_ROWS_CASES.get(case[0], case) for case in CASES] if family == "sana" else CASES
        for name, height, width, text_len, batch in cases:
            model = _model(family, text_len)
            inputs = tiny_inputs(family, batch, height=height, width=width, text_len=text_len)
            with torch.no_grad():
                reference = sample(model(**inputs))
            pointers = [p.data_ptr() for p in model.parameters()]
            model = parallelize(model, config, mesh)
            with torch.no_grad(), comm_log() as log:
                output = sample(model(**inputs))
            unmasked_error = None
            if family in UNMASKED:  # the control: padded text attended as if it were real
                key, value = UNMASKED[family]
                value = torch.ones_like(inputs[key]) if value == "ones" else value
                with torch.no_grad():
                    unmasked = model(**(inputs | {key: value})).sample
                unmasked_error = (unmasked - reference).abs().max().item()
            rows.append(
                dict(
                    config=config.short(),
                    case=name,
                    shape=tuple(output.shape),
                    ref_shape=tuple(reference.shape),
                    error=(output - reference).abs().max().item(),
                    bound=1e-4 * max(1.0, reference.abs().max().item()),
                    groups=sorted({r.group for r in log if r.bytes_out > 0}),
                    weights_shared=pointers == [p.data_ptr() for p in model.parameters()],
                    param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                    unmasked_error=unmasked_error,
                )
            )
    return rows


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_parallel_forward_equals_serial_diffusers(family, world_size):
    per_rank = run_on_ranks(_compare, world_size, family, CONFIGS[world_size], timeout_s=240)
    for rank, rows in enumerate(per_rank):
        for row in rows:
            where = f"{family} {row['config']} {row['case']} rank {rank}"
            assert row["shape"] == row["ref_shape"], where
            assert row["error"] <= row["bound"], f"{where}: error {row['error']:.3g} > {row['bound']:.3g}"
            assert row["weights_shared"], where
            if row["unmasked_error"] is not None:  # padded text: the mask is what makes it exact
                assert row["unmasked_error"] > 10 * row["bound"], f"{where}: unmasked {row['unmasked_error']:.3g}"
            # every degree above 1 shows its traffic in its own group's records
            config = next(c for c in CONFIGS[world_size] if c.short() == row["config"])
            expected = {g for g in ("ulysses", "ring", "cfg", "dp") if getattr(config, g) > 1}
            if config.sp_degree > 1:
                expected.add("sp")
            assert set(row["groups"]) == expected, where
    print(
        f"\n{family}: resident parameter bytes per rank "
        f"{[rows[0]['param_bytes'] for rows in per_rank]} (unchanged by parallelize)"
    )


def _refusal(case: str) -> str | None:
    """What each rank is told: "heads", parallelizing 1 head under ulysses 2 (a ParallelConfigError); "tokens",
    a forward of one patch on two ring ranks (a ValueError). None: nothing was refused."""
    error_type = {"heads": ParallelConfigError, "tokens": ValueError}[case]
    try:
        if case == "heads":
            parallelize(tiny_transformer("pixart", heads=1), ParallelConfig(ulysses=2))
        else:
            model = parallelize(tiny_transformer("pixart"), ParallelConfig(ring=2))
            model(**tiny_inputs("pixart", 1, height=2, width=2))  # one patch for two ranks
    except error_type as error:
        return str(error)


def test_heads_checked_at_parallelize_time():
    messages = run_on_ranks(_refusal, 2, "heads")
    assert all("1 attention heads cannot give each of ulysses 2 ranks a head" in m for m in messages)


def test_too_few_tokens_fails_before_any_kernel():
    messages = run_on_ranks(_refusal, 2, "tokens")
    assert all("1 image tokens cannot be split over 2 sequence-parallel ranks" in m for m in messages)


def test_unsupported_class_names_supported_ones():
    import diffusers

    unet = diffusers.UNet2DModel(
        sample_size=8,
        block_out_channels=(8,),
        down_block_types=("DownBlock2D",),
        up_block_types=("UpBlock2D",),
        norm_num_groups=4,
        layers_per_block=1,
    )
    with pytest.raises(
        TypeError, match="cannot parallelize UNet2DModel; supported transformers: .*PixArtTransformer2DModel"
    ):
        parallelize(unet, ParallelConfig())


def test_diffusers_version_outside_range_is_named():
    with pytest.raises(RuntimeError, match=r"diffusers 0\.30\.0 is installed, but .* >= 0\.42, < 0\.43"):
        check_diffusers_version("0.30.0")
    check_diffusers_version()  # the installed one is supported


def _flux2_reference_cache():
    model = parallelize(tiny_transformer("flux2"), ParallelConfig(ulysses=2))
    try:
        with torch.no_grad():
            model(**tiny_inputs("flux2", 2), kv_cache_mode="extract", num_ref_tokens=4)
    except NotImplementedError as error:
        return str(error)


def test_what_sequence_parallelism_cannot_split_yet_is_refused_by_name():
    """Flux.2's reference-image K/V cache: refused, not run on shards. (What follows the shard instead, a
    timestep or a modulation index per token, is tests/test_per_token.py.)"""
    for message in run_on_ranks(_flux2_reference_cache, 2, timeout_s=120):
        assert message and "kv_cache_mode" in message and "cfg and dp only" in message, message


def _refused_shapes():
    """(what PipeFusion says of an edit's reference image of fewer token rows than patches, what ulysses says of
    a mask over image keys): each on 2 ranks."""
    messages = []
    model = parallelize(tiny_transformer("qwenimage", layers=2), ParallelConfig(pipefusion=2))
    inputs = tiny_inputs("qwenimage", 2) | {"img_shapes": [[(1, 2, 4), (1, 1, 8)]] * 2}  # a reference of 1 row
    flux = parallelize(tiny_transformer("flux"), ParallelConfig(ulysses=2))
    flux_inputs = tiny_inputs("flux", 2)
    keys = flux_inputs["hidden_states"].shape[1] + flux_inputs["encoder_hidden_states"].shape[1]
    mask = {"attention_mask": torch.ones(2, keys, dtype=torch.bool)}
    for run in (lambda: model(**inputs), lambda: flux(**flux_inputs, joint_attention_kwargs=mask)):
        try:
            with torch.no_grad():
                run()
        except (NotImplementedError, ValueError) as error:
            messages.append(str(error))
    return messages


def test_what_qwen_image_cannot_split_is_refused_by_name():
    """An edit's reference image of one token row under PipeFusion, which cuts every image into as many row
    bands as patches; and a mask that is not a padded-text key mask (Flux given one) under ulysses."""
    for thin_image, flux_mask in run_on_ranks(_refused_shapes, 2, timeout_s=120):
        assert "2 patches are more than the 1 token rows" in thin_image, thin_image
        assert "transformer_blocks.0.attn (joint_first attention of flux) passes an attention mask" in flux_mask
        assert "padded-text key mask" in flux_mask


# ---- the joint text is split too: rows per rank through the blocks' linear layers ----------------------


def _rows_through_block_linears(model, adapter, run) -> int:
    """Rows (batch × tokens) that every nn.Linear inside the model's blocks took during `run()`."""
    rows, handles = [0], []

    def count(_module, args):
        rows[0] += args[0].shape[:-1].numel()

    for block in adapter.blocks(model):
        for module in block.modules():
            if isinstance(module, torch.nn.Linear):
                handles.append(module.register_forward_pre_hook(count))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    return rows[0]


def _rows_per_rank(image_side: int, text_len: int):
    """Tiny Flux, 1 sample of image_side² image tokens and text_len text tokens, under ulysses 2: rows per
    rank through the blocks' linear layers for diffusers' own context parallelism (enable_parallelism
    with a ContextParallelConfig, torch.accelerator.device_count patched to 1 as on any CPU), ours,
    and ours with the text whole on every rank (the control); and each output's error against serial."""
    import copy
    from unittest import mock

    from diffusers import ContextParallelConfig

    from xdit_lab.families import adapter_for
    from xdit_lab.models import Controls

    config = ParallelConfig(ulysses=2)
    model = tiny_transformer("flux", seed=0)
    adapter = adapter_for(model)
    inputs = tiny_inputs("flux", 1, height=image_side, width=image_side, text_len=text_len)
    with torch.no_grad():
        reference = model(**inputs).sample
    serial_rows = _rows_through_block_linears(model, adapter, lambda: model(**inputs))

    peer = copy.deepcopy(model)
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        peer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    mesh = RankMesh(config)
    ours = parallelize(copy.deepcopy(model), config, mesh)
    # the control: the text whole on every rank, as before
    control = parallelize(copy.deepcopy(model), config, mesh, controls=Controls(shards_text=False))
    rows, errors = {}, {}
    for name, candidate in (("diffusers", peer), ("ours", ours), ("control", control)):
        out = {}

        def run(candidate=candidate, out=out):
            with torch.no_grad():  # diffusers' gather hook takes the tuple output only
                out["sample"] = candidate(**inputs, return_dict=False)[0]

        rows[name] = _rows_through_block_linears(candidate, adapter, run)
        errors[name] = ((out["sample"] - reference).abs().max() / reference.abs().max()).item()
    return dict(serial=serial_rows, rows=rows, errors=errors)


def test_rows_per_rank_through_the_blocks_are_at_most_diffusers_context_parallel():
    """Each rank pushes its share of the text through every linear layer of the blocks, as diffusers'
    context parallelism does (it splits encoder_hidden_states and txt_ids at the forward's input): on a
    tiny Flux with 256 image and 64 text tokens under ulysses 2, ours takes no more rows than diffusers',
    and half the serial rows give or take the modulation layers (one row per sample). The control, the
    text whole on every rank as before, takes more than diffusers' (every rank pushed all 64 text tokens)."""
    for result in run_on_ranks(_rows_per_rank, 2, 16, 64, timeout_s=240):
        rows, errors = result["rows"], result["errors"]
        assert all(error < 1e-4 for error in errors.values()), errors
        assert rows["ours"] <= rows["diffusers"], rows
        assert rows["control"] > rows["diffusers"], rows
        assert rows["ours"] < 0.55 * result["serial"], (rows, result["serial"])
    print(f"\nrows per rank through the blocks' linear layers: {rows}, serial {result['serial']}")


def _zimage_rows_per_rank():
    """Tiny Z-Image, 2 samples (32 image tokens each with its padding; captions padded to 32 and 64 tokens) under
    ulysses 2: rows per rank through its main layers' linear layers, ours and the control (the caption whole on
    every rank), each output's error against serial, and the serial rows."""
    import copy

    from xdit_lab.families import adapter_for
    from xdit_lab.models import Controls

    config = ParallelConfig(ulysses=2)
    model = tiny_transformer("zimage", seed=0)
    adapter = adapter_for(model)
    inputs = tiny_inputs("zimage", 2, text_len=8)
    with torch.no_grad():
        reference = sample(model(**inputs))
    serial = _rows_through_block_linears(model, adapter, lambda: model(**inputs))
    mesh = RankMesh(config)
    rows, errors = {}, {}
    for name, controls in (("ours", None), ("control", Controls(shards_text=False))):
        candidate, out = parallelize(copy.deepcopy(model), config, mesh, controls=controls), {}

        def run(candidate=candidate, out=out):
            with torch.no_grad():
                out["sample"] = sample(candidate(**inputs))

        rows[name] = _rows_through_block_linears(candidate, adapter, run)
        errors[name] = ((out["sample"] - reference).abs().max() / reference.abs().max()).item()
    return dict(serial=serial, rows=rows, errors=errors)


def test_zimage_splits_the_caption_its_forward_joins_to_the_image():
    """Z-Image's forward joins [image; caption] before its main layers: each rank keeps its share of the caption
    there beside its image shard, so its layers take about half the serial rows (the modulation's one row per sample
    aside); the control, the caption whole on every rank, takes more. Both exact."""
    for result in run_on_ranks(_zimage_rows_per_rank, 2, timeout_s=120):
        rows, errors = result["rows"], result["errors"]
        assert all(error < 1e-4 for error in errors.values()), errors
        assert rows["ours"] < 0.55 * result["serial"] < rows["control"], (rows, result["serial"])


# ---- Sana: linear attention's sums all-reduced, the feed-forward's convolution with halo rows ----------------


def _sana_pieces():
    """A tiny Sana (3 heads, 8 × 6 latent, 3 samples) on 4 ranks: under ulysses 2 × ring 2 and ring 4 against
    serial, each call's bytes beside the closed form; the control, Controls(exchanges_halo=False): each band
    convolved alone, zeros beyond its edges; PipeFusion 2 × dp 2 (3 patches) over its warm-up, then its patch
    steps on the kept sums and edge rows: on the same input again (stale = fresh) and on another (stale), with
    what it keeps beside its closed form; and what is refused by name: token rows that are no multiple of sp,
    PipeFusion with ulysses within a stage."""
    from forward_traffic import traffic_row

    from xdit_lab import ParallelConfigError
    from xdit_lab.models import Controls, parallel_state

    inputs = tiny_inputs("sana", 3, height=8, width=6, text_len=7)
    references = {}
    with torch.no_grad():
        for layers in (2, 4):
            references[layers] = tiny_transformer("sana", heads=3, layers=layers)(**inputs).sample
    bound = 1e-4 * max(1.0, references[2].abs().max().item())
    rows, refused = {}, {}
    for config in (ParallelConfig(ulysses=2, ring=2), ParallelConfig(ring=4)):
        mesh = RankMesh(config)
        parallel = parallelize(tiny_transformer("sana", heads=3), config, mesh)
        control = parallelize(tiny_transformer("sana", heads=3), config, mesh, controls=Controls(exchanges_halo=False))
        with torch.no_grad(), comm_log() as log:
            output = parallel(**inputs).sample
        traffic = traffic_row(parallel, inputs, log, 0)
        with torch.no_grad():
            no_halo = control(**inputs).sample
        rows[config.short()] = dict(
            error=(output - references[2]).abs().max().item() / bound,
            traffic=traffic,
            no_halo_error=(no_halo - references[2]).abs().max().item() / bound,
        )
    config = ParallelConfig(pipefusion=2, dp=2, num_patches=3, warmup_steps=1)
    mesh = RankMesh(config)
    staged = parallelize(tiny_transformer("sana", heads=3, layers=4), config, mesh)
    other = tiny_inputs("sana", 3, height=8, width=6, text_len=7, seed=5)
    with torch.no_grad():
        other_reference = tiny_transformer("sana", heads=3, layers=4)(**other).sample
        rows["warm-up"] = dict(error=(staged(**inputs).sample - references[4]).abs().max().item() / bound)
        rows["patch steps, same input"] = dict(
            error=(staged(**inputs).sample - references[4]).abs().max().item() / bound
        )
        stale_error = (staged(**other).sample - other_reference).abs().max().item() / bound
    strategy = parallel_state(staged).strategy
    kept = strategy.report().kept_bytes["stale K/V"]
    planned = strategy.planned_kept_bytes(staged, 2 if mesh.group_rank("dp") == 0 else 1, (8, 6))["stale K/V"]
    stale = dict(error=stale_error, kept=kept, planned=planned)
    config = ParallelConfig(ring=4)
    odd_rows = parallelize(tiny_transformer("sana"), config, RankMesh(config))
    try:
        with torch.no_grad():
            odd_rows(**tiny_inputs("sana", 1, height=6, width=6))
    except ValueError as error:
        refused["rows"] = str(error)
    try:
        parallelize(tiny_transformer("sana"), ParallelConfig(pipefusion=2, ulysses=2))
    except ParallelConfigError as error:
        refused["pipefusion sp"] = str(error)
    return rows, stale, refused


def test_sana_sums_and_halos_are_exact_counted_and_needed():
    """Sana's linear attention (its sums all-reduced over ulysses, then ring) and its feed-forward's 3 × 3
    convolution (one halo row from each neighbouring band) equal diffusers' serial forward under ulysses 2 ×
    ring 2 and ring 4, with each rank's bytes equal to the closed form; the control, each band convolved alone,
    is off by far more than the bound. PipeFusion over its warm-up is exact too, and so are its patch steps where
    the kept sums and edge rows equal fresh ones (the same input again: a patch, an edge row or a layer mixed up
    would show); on another input they are stale, off by more than the bound and less than the whole output, and
    what a stage keeps is its closed form. Token rows that sp does not divide and PipeFusion with ulysses within
    a stage are refused by name."""
    for rank, (rows, stale, refused) in enumerate(run_on_ranks(_sana_pieces, 4, timeout_s=240)):
        for name, row in rows.items():
            assert row["error"] <= 1, (rank, name, row["error"])
            if "traffic" in row:
                assert row["traffic"]["moved"] == row["traffic"]["expected"], (rank, name, row["traffic"])
                assert row["traffic"]["moved"]["sp"] > 0, (rank, name)
                assert row["no_halo_error"] > 10, (rank, name, row["no_halo_error"])
        assert "must hold whole token rows: 6 rows of 6 tokens" in refused["rows"], refused
        assert "ulysses = ring = 1 within a stage" in refused["pipefusion sp"], refused
        assert 1 < stale["error"] < 1e4, stale  # in bounds of 1e-4: off, and by less than the whole output
        assert stale["kept"] == stale["planned"] > 0, stale
