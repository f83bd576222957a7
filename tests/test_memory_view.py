"""The memory view with sharded weights and placed text encoders, and the explorer's planning of a model folder.

On 2 real gloo ranks, a tiny Flux pipeline (two text encoders) loaded with shard_weights=True and its T5
(text_encoder_2) kept in host memory, stepped once; then, on the same ranks, the same pipeline loaded whole:
the control, which shows that the checks below can fail; then with int8 weights. rank_summary's memory["components"] must equal what
the test counts on the rank tensor by tensor (a parameter's local shard, the buffers its state_dict saves),
and each sharded component about half of the whole as safetensors' own reader counts it from the files.

The planning mode is checked on a header-only FLUX.1-dev folder (sparse: no weights on disk) against the
published transformer size, and the smallest GPU it names against planning again with that memory.
"""

import pytest
import torch

from xdit_lab import ParallelConfig, load_pipeline
from xdit_lab.testing import run_on_ranks
from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

ON_HOST = ("text_encoder_2",)
FLUX_DEV_TRANSFORMER_BYTES = 23_802_816_640  # FLUX.1-dev's published transformer, bf16 (REAL-MODELS.md)


def _counted(module) -> dict:
    """What this rank holds of a module, counted here tensor by tensor: the local shard of every parameter
    (a DTensor's to_local()), and every buffer the module's state_dict saves, whole."""
    saved = set(module.state_dict())
    params = [(p.to_local() if hasattr(p, "to_local") else p) for p in module.parameters()]
    buffers = [b for name, b in module.named_buffers() if name in saved]
    return dict(
        params=sum(t.numel() * t.element_size() for t in params),
        buffers=sum(t.numel() * t.element_size() for t in buffers),
        dtensors=sum(hasattr(p, "to_local") for p in module.parameters()),
    )


def _summaries(folder):
    """On each rank: the summary after one step and the test's own count, sharded (one encoder on the host),
    then whole (the control)."""
    from xdit_lab.lab.summaries import rank_summary

    out = {}
    runs = (("sharded", dict(shard_weights=True, on_host=ON_HOST)), ("whole", {}), ("int8", dict(quantization="int8")))
    for name, keywords in runs:
        pipe = load_pipeline(folder, ParallelConfig(ulysses=2), progress=False, **keywords)
        session = pipe.session(["a red cat"], seed=0, **dict(tiny_pipeline_kwargs("flux"), num_inference_steps=2))
        session.step()
        inner = pipe.diffusers_pipeline
        modules = {n: c for n, c in inner.components.items() if isinstance(c, torch.nn.Module)}
        out[name] = dict(summary=rank_summary(session), counted={n: _counted(c) for n, c in modules.items()})
        pipe.close()
    return out


@pytest.fixture(scope="module")
def flux(tmp_path_factory):
    folder = save_tiny_pipeline("flux", tmp_path_factory.mktemp("flux"))
    return folder, run_on_ranks(_summaries, 2, folder, timeout_s=300)


def _from_files(folder, component) -> int:
    """Bytes of a component's tensors as safetensors' own reader finds them in its files (stored in float32,
    the dtype the test loads in)."""
    import math

    from safetensors import safe_open

    total = 0
    for path in (folder / component).glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                tensor = f.get_slice(key)
                total += math.prod(tensor.get_shape()) * {"F32": 4, "I64": 8}[tensor.get_dtype()]
    return total


def test_the_summary_reports_each_shard_as_the_rank_holds_it(flux):
    folder, ranks = flux
    for rank, run in enumerate(ranks):
        memory, counted = run["sharded"]["summary"]["memory"], run["sharded"]["counted"]
        components = memory["components"]
        assert set(components) == set(counted) == {"transformer", "text_encoder", "text_encoder_2", "vae"}
        for name, held in components.items():  # what the rank holds, tensor by tensor
            assert held["held_bytes"] == counted[name]["params"] + counted[name]["buffers"], (rank, name)
        for name, group in (("transformer", "weights"), ("text_encoder", "world")):
            held = components[name]
            assert held["sharded"] and held["group"] == group and held["shards"] == 2, (rank, name, held)
            whole = _from_files(folder, name)
            assert held["whole_bytes"] == whole, (rank, name)
            assert 0.45 <= held["held_bytes"] / whole <= 0.55, (rank, name, held["held_bytes"], whole)
            assert held["fraction"] == pytest.approx(held["held_bytes"] / whole)
        # the two ranks' shards make the whole: nothing padded, nothing held twice (buffers aside)
        for name in ("transformer", "text_encoder"):
            shards = sum(r["sharded"]["counted"][name]["params"] for r in ranks)
            buffers = counted[name]["buffers"]
            assert shards + buffers == _from_files(folder, name), name
        host = components["text_encoder_2"]
        assert host["on_host"] and not host["sharded"] and counted["text_encoder_2"]["dtensors"] == 0
        assert host["held_bytes"] == _from_files(folder, "text_encoder_2") and host["fraction"] == 1.0
        assert not components["vae"]["on_host"] and not components["vae"]["sharded"]
        assert not components["transformer"]["on_host"]
        # the plan beside: nothing of the host's encoder on the device; the gather buffer a sharded forward holds
        plan = memory["plan"]
        assert plan["on_host"] == ["text_encoder_2"] and plan["per_rank_bytes"]["text_encoder_2"] == 0
        assert memory["weight_gather_bytes"] > components["transformer"]["held_bytes"]  # whole blocks and the root
        assert memory["weight_gather_bytes"] == plan["activation_bytes"]["weight gathers"]


def test_the_whole_load_is_reported_whole(flux):
    """The control: the same pipeline loaded without shard_weights and on_host reports every component
    whole, on the device, with no gather buffer, so the checks above tell the two apart."""
    folder, ranks = flux
    for run in ranks:
        memory, counted = run["whole"]["summary"]["memory"], run["whole"]["counted"]
        for name, held in memory["components"].items():
            assert not held["sharded"] and not held["on_host"] and held["fraction"] == 1.0, name
            assert held["held_bytes"] == counted[name]["params"] + counted[name]["buffers"] == _from_files(folder, name)
        assert memory["weight_gather_bytes"] == 0 and "weight gathers" not in memory["plan"]["activation_bytes"]
        assert memory["plan"]["on_host"] == []


def test_the_memory_view_draws_shards_gathers_and_the_host(flux, tmp_path):
    from matplotlib.patches import Rectangle

    from xdit_lab.lab.views import draw_memory, legibility_problems
    from xdit_lab.plan import human_bytes

    _, ranks = flux
    sharded = draw_memory([run["sharded"]["summary"] for run in ranks])
    whole = draw_memory([run["whole"]["summary"] for run in ranks])
    for fig in (sharded, whole):
        assert not legibility_problems(fig), legibility_problems(fig)
    labels = [t.get_text() for t in sharded.legends[0].get_texts()]
    for expected in (
        "transformer (FSDP2 shard, weights group)",
        "text_encoder (FSDP2 shard, world group)",
        "weight gathers (during a forward)",
        "text_encoder_2 (in host memory)",
    ):
        assert expected in labels, labels
    # the decode in two bands against the whole decode, both planned from the VAE's config
    plan = ranks[0]["sharded"]["summary"]["memory"]["plan"]
    banded, whole_decode = plan["activation_bytes"]["decode peak"], plan["decode_peak_whole"]
    assert 0 < banded < whole_decode, (banded, whole_decode)
    assert f"decode peak (planned, in bands; whole {human_bytes(whole_decode)})" in labels, labels
    measured, plan = sharded.axes[0], sharded.axes[1]
    # per rank: 3 components on the device, K/V buffers, activations, the gathers; and the host's bar
    assert len([p for p in measured.patches if isinstance(p, Rectangle)]) == 2 * (6 + 1)
    fractions = [t.get_text() for t in measured.texts if t.get_text().endswith("%")]
    assert fractions == ["50%", "50%"]  # the transformer's share on each rank
    assert [t.get_text() for t in plan.get_xticklabels()] == ["device", "host"]
    whole_labels = [t.get_text() for t in whole.legends[0].get_texts()]
    assert "transformer" in whole_labels and not [
        label for label in whole_labels if "host" in label or "FSDP2" in label
    ]
    assert len([p for p in whole.axes[0].patches if isinstance(p, Rectangle)]) == 2 * (4 + 2)
    sharded.savefig(tmp_path / "memory.png")
    assert (tmp_path / "memory.png").stat().st_size > 1000


# ---- planning a model folder (no engines) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    from xdit_lab.real_models import save_header_only

    return save_header_only("FLUX.1-dev", tmp_path_factory.mktemp("real") / "flux-dev")


def test_flux_dev_on_four_24gb_gpus_fits_only_sharded_under_ulysses4(flux_dev):
    from xdit_lab.lab.folder_planning import folder_plan_html, plan_folder

    plan = plan_folder(flux_dev, 4, "24GB")
    assert plan.gpu_memory_bytes == 24 * 10**9 and plan.fits and plan.smallest is None
    assert "FluxPipeline" in plan.heading and "4 GPU(s) of 24 GB" in plan.heading
    fits = [row.fits for row in plan.rows]
    assert fits == sorted(fits, reverse=True)  # every fitting row before the first that does not fit
    ulysses4 = {(row.sharded, row.text_encoders): row for row in plan.rows if row.config == "ulysses4"}
    # what load_pipeline can hold: all whole, all sharded (shard_weights: the transformer and the text encoders),
    # or either with the text encoders on the host
    assert set(ulysses4) == {(False, "gpu"), (True, "sharded"), (False, "host"), (True, "host")}
    for (sharded, placement), row in ulysses4.items():
        assert row.fits == sharded, (sharded, placement, row)
        if not sharded:  # replicated: the whole published transformer on every GPU, and more
            assert row.gb_per_rank > FLUX_DEV_TRANSFORMER_BYTES / 1e9
        else:
            assert row.gb_per_rank > FLUX_DEV_TRANSFORMER_BYTES / 4 / 1e9
    page = folder_plan_html(plan)
    assert "<th>GB/rank</th>" in page and "ulysses4" in page and "nothing fits" not in page


def test_when_nothing_fits_the_plan_names_the_smallest_gpu_that_would(flux_dev):
    from xdit_lab.lab.folder_planning import folder_plan_html, plan_folder

    plan = plan_folder(flux_dev, 2, "8GB")
    assert not plan.fits and plan.smallest.startswith("nothing fits 2 × 8 GB: the smallest GPU that would is")
    assert "nothing fits" in folder_plan_html(plan)
    smallest = plan.smallest_fit_bytes
    assert plan_folder(flux_dev, 2, smallest).fits  # with that much memory, something fits
    assert not plan_folder(flux_dev, 2, smallest - 1).fits  # a byte less, nothing does


@pytest.mark.parametrize(
    "folder, gpus, memory, message",
    [
        ("", 4, "24GB", "give a model folder"),
        ("/nonexistent/model", 4, "24GB", "not a diffusers model folder (no model_index.json there)"),
        (None, 0, "24GB", "positive number of GPUs"),
        (None, 4, "24 gigs", "expected a memory size such as 24GB"),
        (None, 4, 0, "at least one byte"),
    ],
)
def test_a_wrong_folder_gpu_count_or_memory_is_said(flux_dev, folder, gpus, memory, message):
    from xdit_lab.lab.folder_planning import plan_folder

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_folder(flux_dev if folder is None else folder, gpus, memory)


def test_quantized_components_are_reported_and_drawn_with_their_scheme(flux):
    """Loaded with quantization="int8": the transformer and both text encoders say int8, each holds what the
    plan counted from the headers (the closed form of quantization.SCHEMES, not the summary's count), under
    the float32 files (the transformer, mostly linear weights, under half); the VAE stays plain. The whole load (the control) says no scheme."""
    from xdit_lab.lab.views import draw_memory

    folder, ranks = flux
    for run in ranks:
        memory = run["int8"]["summary"]["memory"]
        for name in ("transformer", "text_encoder", "text_encoder_2"):
            held = memory["components"][name]
            assert held["quantized"] == ["int8"] and not held["sharded"], (name, held)
            assert held["held_bytes"] == memory["plan"]["per_rank_bytes"][name], name
            assert held["held_bytes"] < _from_files(folder, name), name  # tiny encoders: mostly embeddings
        transformer = memory["components"]["transformer"]["held_bytes"]
        assert transformer < 0.5 * _from_files(folder, "transformer")
        assert memory["components"]["vae"]["quantized"] == []
        assert all(not c["quantized"] for c in run["whole"]["summary"]["memory"]["components"].values())
    labels = [t.get_text() for t in draw_memory([run["int8"]["summary"] for run in ranks]).legends[0].get_texts()]
    assert "transformer (int8 weights)" in labels and "text_encoder_2 (int8 weights)" in labels, labels
