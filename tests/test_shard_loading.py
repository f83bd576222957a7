"""Streamed per-rank loading (xdit_lab.shard_loading) against references no one here wrote: the
tensors as safetensors' own reader returns them, FSDP2's own full_tensor() and all-gathered forward,
diffusers' from_pretrained run unsharded, and the kernel's own counters of a process's memory
(VmHWM, reset through /proc/self/clear_refs) and reads (/proc/self/io)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch

from xdit_lab.safetensors_io import CorruptWeightsError
from xdit_lab.shard_loading import WeightsMismatchError, load_weights, materialize
from xdit_lab.testing import reset_peak, run_on_ranks, status_kib

MiB = 2**20


# ---- helpers run on the ranks -----------------------------------------------------------------------------------


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _fully_shard(model, mesh):
    """FSDP2 as a sharded inference model uses it: each block of every block list, then the root."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if isinstance(child, torch.nn.ModuleList):
            for block in child:
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    return model


def _diffusers_class(folder):
    import diffusers

    return getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])


def _empty_diffusers(folder, *, meta: bool):
    """The diffusers model of `folder` without weights: under torch.device('meta') (buffers too) or
    accelerate's init_empty_weights (buffers real)."""
    from accelerate import init_empty_weights

    cls = _diffusers_class(folder)
    config = cls.load_config(folder)
    with torch.device("meta") if meta else init_empty_weights():
        return cls.from_config(config)


def _saved(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a folder as safetensors' own reader returns it (the reference)."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _fsdp_equality(folder, family, meta):
    """Build empty, fully_shard over the ranks, materialize, load_weights; compare each parameter's
    full_tensor() with the saved tensor, and the sharded forward with diffusers' unsharded one."""
    from xdit_lab.tiny import tiny_inputs

    torch.manual_seed(0)
    model = _fully_shard(_empty_diffusers(folder, meta=meta), _mesh())
    before = {n: b.clone() for n, b in model.named_buffers() if not b.is_meta}
    materialize(model, "cpu")
    buffers_kept = all(torch.equal(before[n], b) for n, b in model.named_buffers() if n in before)
    io_before = _io()
    report = load_weights(model, folder, dtype=torch.float32)
    rchar = _io()["rchar"] - io_before["rchar"]
    saved = _saved(folder)
    reference = _diffusers_class(folder).from_pretrained(folder).eval()  # unsharded, diffusers' own loader
    unequal = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), saved[n])]
    unequal += [n for n, b in model.named_buffers() if not torch.equal(b, dict(reference.named_buffers())[n])]
    with torch.no_grad():
        inputs = tiny_inputs(family)
        ours = model(**inputs, return_dict=False)[0]
        theirs = reference(**inputs, return_dict=False)[0]
    local = sum(p.to_local().numel() * 4 for p in model.parameters())
    whole = sum(p.numel() * 4 for p in model.parameters())
    return dict(
        unequal=unequal,
        keys=len(saved),
        buffers_kept=buffers_kept,
        forward_rel_error=((ours - theirs).abs().max() / theirs.abs().max()).item(),
        local_bytes=local,
        whole_bytes=whole,
        reported_bytes=report.bytes_read,
        rchar=rchar,
        files=len(report.files),
    )


def _io() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f.read().splitlines())}


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory):
    """A tiny Flux saved as one file; a tiny PixArt (a non-persistent sin-cos position table) saved
    in several files with an index.json."""
    from xdit_lab.tiny import tiny_transformer

    root = tmp_path_factory.mktemp("tiny")
    tiny_transformer("flux").save_pretrained(root / "flux")
    tiny_transformer("pixart").save_pretrained(root / "pixart", max_shard_size="200KB")
    return root


def test_fsdp_shards_load_the_saved_tensors_and_forward_like_diffusers(tiny_folders):
    """Flux built on meta, PixArt under init_empty_weights (its buffer real), each fully_shard-ed per
    block and root over 2 gloo ranks: every full_tensor() equals the saved tensor bit for bit, the
    sharded forward equals diffusers' from_pretrained unsharded within 1e-6, and each rank read its
    half of the bytes (rchar, the bytes read() returned to it)."""
    assert len(list((tiny_folders / "pixart").glob("*.safetensors"))) > 1
    for family, meta in (("flux", True), ("pixart", False)):
        results = run_on_ranks(_fsdp_equality, 2, tiny_folders / family, family, meta, timeout_s=120)
        for rank, r in enumerate(results):
            assert r["unequal"] == [], (family, rank, r["unequal"])
            assert r["buffers_kept"]
            assert r["forward_rel_error"] <= 1e-6, (family, r["forward_rel_error"])
            assert abs(r["local_bytes"] / r["whole_bytes"] - 0.5) < 0.02, r  # each rank holds half
            # what it read: its half of the weights (plus small tensors it holds whole), not the file
            assert r["reported_bytes"] <= r["rchar"] <= r["reported_bytes"] + 256 * 1024, r
            assert r["rchar"] < 0.6 * r["whole_bytes"], r
        assert sum(r["reported_bytes"] for r in results) >= results[0]["whole_bytes"]
        print(family, [(r["forward_rel_error"], r["reported_bytes"], r["rchar"], r["whole_bytes"]) for r in results])


# ---- uneven rows, casts, renames, placements --------------------------------------------------------------------


class _Odd(torch.nn.Module):
    """Parameters whose rows do not split evenly over 2 ranks (5 rows: 3 and 2; 1 row: 1 and none),
    a persistent int buffer, a persistent float buffer and a non-persistent table computed here."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(5, 3))
        self.b = torch.nn.Parameter(torch.zeros(1, 4))
        self.c = torch.nn.Parameter(torch.zeros(7))
        self.inner = torch.nn.Linear(3, 2)
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
        self.register_buffer("scale", torch.zeros(4))
        self.register_buffer("table", torch.arange(6.0).sin(), persistent=False)


def _odd_files(folder):
    """_Odd's tensors saved as a checkpoint of a bigger model: every key under "model.", some in
    bfloat16, one key of another part ("head.w", for no one here), in two files with an index."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    tensors = {
        "model.a": torch.randn(5, 3, generator=g),
        "model.b": torch.randn(1, 4, generator=g).to(torch.bfloat16),
        "model.c": torch.randn(7, generator=g),
        "model.inner.weight": torch.randn(2, 3, generator=g).to(torch.bfloat16),
        "model.inner.bias": torch.randn(2, generator=g),
        "model.steps": torch.tensor([4, 5, 6]),
        "model.scale": torch.randn(4, generator=g),
        "head.w": torch.randn(3, 3, generator=g),
    }
    first = ["model.a", "model.b", "head.w"]
    save_file({k: tensors[k] for k in first}, folder / "w-1.safetensors")
    save_file({k: v for k, v in tensors.items() if k not in first}, folder / "w-2.safetensors")
    weight_map = {k: "w-1.safetensors" if k in first else "w-2.safetensors" for k in tensors}
    (folder / "w.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def _uneven(folder, dtype):
    from accelerate import init_empty_weights
    from safetensors.torch import load_file
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = _mesh()
    with init_empty_weights():
        model = _Odd()
    fully_shard(model, mesh=mesh)
    materialize(model, "cpu", dtype=dtype)
    rename = lambda key: None if key.startswith("head.") else key.removeprefix("model.")  # noqa: E731
    report = load_weights(model, folder, dtype=dtype, rename=rename)
    saved = load_file(folder / "w-1.safetensors") | load_file(folder / "w-2.safetensors")
    full = {n: p.full_tensor() for n, p in model.named_parameters()} | dict(model.named_buffers())
    unequal = [n for n, t in full.items() if n != "table" and not torch.equal(t, saved[f"model.{n}"].to(t.dtype))]
    # a placement that is not a row range of the file
    other = torch.nn.Module()
    other.a = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 3), mesh, [Shard(1)]))
    try:
        load_weights(other, folder, dtype=torch.float32, rename=lambda k: "a" if k == "model.a" else None)
        refused = None
    except WeightsMismatchError as error:
        refused = str(error)
    return dict(
        unequal=unequal,
        rows={n: p.to_local().shape[0] for n, p in model.named_parameters()},
        dtypes={n: t.dtype for n, t in full.items()},
        table_kept=torch.equal(model.table, torch.arange(6.0).sin()),
        skipped=report.skipped,
        refused=refused,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_uneven_rows_casts_and_renames_on_two_ranks(tmp_path, dtype):
    """Rows that do not split evenly land where torch.chunk puts them (3 + 2, 1 + 0), files in
    bfloat16 and float32 are cast to the dtype asked for (the int buffer keeps its own; the float
    buffer accelerate kept real in float32 is replaced in that dtype), rename strips a prefix and
    skips another part's key, the computed table survives, and a Shard(1) tensor is refused by name."""
    _odd_files(tmp_path)
    results = run_on_ranks(_uneven, 2, tmp_path, dtype, timeout_s=120)
    rows = [r["rows"] for r in results]
    assert rows == [
        {"a": 3, "b": 1, "c": 4, "inner.weight": 1, "inner.bias": 1},
        {"a": 2, "b": 0, "c": 3, "inner.weight": 1, "inner.bias": 1},
    ]
    for r in results:
        assert r["unequal"] == [], r
        assert r["dtypes"]["steps"] == torch.int64 and r["dtypes"]["table"] == torch.float32
        assert {r["dtypes"][n] for n in ("a", "b", "c", "inner.weight", "scale")} == {dtype}
        assert r["table_kept"] and r["skipped"] == ["head.w"]
        assert "'a'" in r["refused"] and "Shard(dim=1)" in r["refused"] and "Shard(0)" in r["refused"]


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def test_plain_module_tied_weights_and_small_chunks(tmp_path):
    """Without FSDP every tensor is read whole; a tied weight saved once (safetensors' save_model)
    fills both names; reading in 12-byte chunks (direct and through the cast's staging buffer) gives
    the same tensors as one read."""
    from safetensors.torch import load_file, save_model

    torch.manual_seed(0)
    saved_model = _Tied()
    save_model(saved_model, str(tmp_path / "t.safetensors"))
    assert len(load_file(tmp_path / "t.safetensors")) == 1  # stored once
    for dtype, chunk in ((torch.float32, 12), (torch.bfloat16, 12), (torch.float32, 2**20)):
        with torch.device("meta"):
            model = _Tied()
        materialize(model, "cpu", dtype=dtype)
        assert model.head.weight is model.emb.weight  # still tied
        report = load_weights(model, tmp_path / "t.safetensors", dtype=dtype, chunk_bytes=chunk)
        assert torch.equal(model.head.weight, saved_model.emb.weight.to(dtype))
        assert report.tensors == 1 and report.bytes_read == 10 * 4 * 4


def test_to_empty_wipes_computed_buffers_and_materialize_keeps_them(tiny_folders):
    """PixArt's sin-cos position table is a non-persistent buffer computed at construction: after
    nn.Module.to_empty it is uninitialised memory; after materialize it equals diffusers' own (from
    from_pretrained); built on meta it is lost, and materialize says so by name."""
    folder = tiny_folders / "pixart"
    reference = _diffusers_class(folder).from_pretrained(folder).pos_embed.pos_embed
    wiped = _empty_diffusers(folder, meta=False).to_empty(device="cpu")
    assert not torch.equal(wiped.pos_embed.pos_embed, reference)
    kept = materialize(_empty_diffusers(folder, meta=False), "cpu")
    assert torch.equal(kept.pos_embed.pos_embed, reference)
    assert all(not p.is_meta for p in kept.parameters())
    with pytest.raises(WeightsMismatchError, match=r"pos_embed\.pos_embed.*init_empty_weights"):
        materialize(_empty_diffusers(folder, meta=True), "cpu")


# ---- errors -----------------------------------------------------------------------------------------------------


class _Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 6)
        self.register_buffer("count", torch.zeros(2, dtype=torch.int64))


def _small_tensors():
    return {"lin.weight": torch.randn(6, 4), "lin.bias": torch.randn(6), "count": torch.tensor([1, 2])}


def _nan_model():
    model = _Small()
    torch.nn.init.constant_(model.lin.weight, float("nan"))
    return model


def _raw_file(path, header: bytes, data: bytes = b""):
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def test_errors_name_the_file_the_key_and_the_fix(tmp_path):
    from safetensors.torch import save_file

    def save(name, tensors):
        save_file(tensors, tmp_path / name)
        return tmp_path / name

    # a key the module lacks: found before any data is read (the NaN weight stays NaN)
    model = _nan_model()
    with pytest.raises(WeightsMismatchError) as error:
        load_weights(model, save("extra.safetensors", _small_tensors() | {"extra.w": torch.ones(1)}), dtype=None)
    assert "extra.safetensors: extra.w" in str(error.value) and "rename=" in str(error.value)
    assert model.lin.weight.isnan().all()

    # a parameter no file has
    tensors = _small_tensors()
    del tensors["lin.bias"]
    with pytest.raises(WeightsMismatchError, match=r"lin\.bias.*would stay uninitialised") as error:
        load_weights(_Small(), save("missing.safetensors", tensors), dtype=None)
    assert "missing.safetensors" in str(error.value)

    # a shape mismatch
    tensors = _small_tensors() | {"lin.weight": torch.randn(6, 5)}
    with pytest.raises(WeightsMismatchError) as error:
        load_weights(_Small(), save("shape.safetensors", tensors), dtype=None)
    message = str(error.value)
    assert "shape.safetensors: 'lin.weight'" in message and "(6, 5)" in message and "(6, 4)" in message
    assert "config.json" in message

    # a float parameter in another dtype than asked; a parameter still on meta
    good = save("good.safetensors", _small_tensors())
    with pytest.raises(WeightsMismatchError, match=r"'lin\.weight'.*materialize\(module, device, dtype=torch\.bf"):
        load_weights(_Small(), good, dtype=torch.bfloat16)
    with torch.device("meta"):
        on_meta = _Small()
    with pytest.raises(WeightsMismatchError, match="call materialize"):
        load_weights(on_meta, good, dtype=None)

    # a header that overruns its file: the tensors' bytes, or the header's own length
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(good.read_bytes()[:-10])
    with pytest.raises(CorruptWeightsError, match=r"truncated\.safetensors is truncated.*'lin\.weight'.*copy it again"):
        load_weights(_Small(), truncated, dtype=None)
    claims = _raw_file(tmp_path / "claims.safetensors", b"{}")
    claims.write_bytes(struct.pack("<Q", 10**9) + b"{}")
    with pytest.raises(CorruptWeightsError, match=r"claims\.safetensors.*header claims 1,000,000,000 bytes"):
        load_weights(_Small(), claims, dtype=None)

    # bad header JSON
    bad = _raw_file(tmp_path / "bad.safetensors", b'{"lin.weight": {"dtype": "F32", ')
    with pytest.raises(CorruptWeightsError, match=r"bad\.safetensors has a corrupt safetensors header.*copy it again"):
        load_weights(_Small(), bad, dtype=None)

    # a header whose byte range does not fit its own shape
    header = json.dumps({"lin.weight": {"dtype": "F32", "shape": [6, 4], "data_offsets": [0, 90]}}).encode()
    odd = _raw_file(tmp_path / "odd.safetensors", header, bytes(96))
    with pytest.raises(CorruptWeightsError, match=r"odd\.safetensors: 'lin\.weight' is F32 \[6, 4\] \(96 bytes\).*90"):
        load_weights(_Small(), odd, dtype=None)

    # an index that names a file the folder lacks
    folder = tmp_path / "indexed"
    folder.mkdir()
    (folder / "m.safetensors.index.json").write_text(json.dumps({"weight_map": {"lin.weight": "gone.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="names gone.safetensors.*copy the whole folder"):
        load_weights(_Small(), folder, dtype=None)


# ---- peak host memory and bytes read ----------------------------------------------------------------------------

BLOCKS, WIDTH = 5, 2048  # 10 weights of 32 MiB: 320 MiB of float32, the largest tensor 32 MiB


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH))
            for _ in range(BLOCKS)
        )


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory):
    """_Blocks' weights, random, saved by safetensors in two files with an index.json, written back
    to the disk (so that posix_fadvise can evict them from the page cache)."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("big")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in _Blocks().state_dict().items()}
    keys = list(shapes)
    halves = {"w-1.safetensors": keys[: len(keys) // 2], "w-2.safetensors": keys[len(keys) // 2 :]}
    g = torch.Generator().manual_seed(0)
    for name, part in halves.items():
        save_file({k: torch.randn(shapes[k], generator=g) for k in part}, folder / name)
        with open(folder / name, "rb") as f:
            os.fsync(f.fileno())
    weight_map = {k: name for name, part in halves.items() for k in part}
    (folder / "w.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def _peak(folder, method):
    """One rank loads its FSDP2 shard of _Blocks (`ours`), or the control reads every file whole with
    safetensors' load_file (`load_file`). The rise of its peak resident set during the load, its
    shard, the largest tensor, and its reads (/proc/self/io)."""
    import torch.distributed as dist
    from safetensors import safe_open
    from safetensors.torch import load_file

    from xdit_lab.shard_loading import rows_of_this_rank

    files = sorted(folder.glob("*.safetensors"))
    with torch.device("meta"):
        model = _fully_shard(_Blocks(), _mesh())
    shard = sum(p.to_local().numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    for f in files:  # out of the page cache, so read_bytes counts what comes from the disk
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    probe = torch.ones(64 * MiB // 4)  # the reset works: a peak 64 MiB above the resident set goes
    del probe
    reset = reset_peak()
    dist.barrier()
    rss, io = status_kib("VmRSS"), _io()
    if method == "ours":
        materialize(model, "cpu")
        load_weights(model, folder, dtype=torch.float32)
    else:
        held = [load_file(f) for f in files]  # tensors map the files, paged in as they are read:
        sum(float(t.sum()) for tensors in held for t in tensors.values())  # read, as a copy into a model does
    rise = (status_kib("VmHWM") - rss) * 1024
    after = _io()
    equal = None
    if method == "ours":  # this rank's rows against safetensors' own reader
        equal = True
        for f in files:
            with safe_open(f, framework="pt") as reader:
                for key in reader.keys():
                    first, rows = rows_of_this_rank(model.get_parameter(key), key)
                    equal &= torch.equal(
                        model.get_parameter(key).to_local(), reader.get_slice(key)[first : first + rows]
                    )
    return dict(
        reset=reset,
        rise=rise,
        shard=shard,
        largest=largest,
        rchar=after["rchar"] - io["rchar"],
        read_bytes=after["read_bytes"] - io["read_bytes"],
        equal=equal,
    )


def test_a_rank_holds_and_reads_only_its_shard(big_folder):
    """320 MiB of float32 in two files, sharded over 2 ranks: the rise of a rank's peak resident set
    while it materializes and loads is within its shard + the largest tensor + 10%, and it reads
    (rchar: bytes read() and pread() returned, which the page cache does not hide) its shard's
    bytes and a few KiB of headers. The control, safetensors.torch.load_file of the same files read
    once, rises past that bound (and its reads, through mmap, are not in rchar at all)."""
    ours = run_on_ranks(_peak, 2, big_folder, "ours", timeout_s=120)
    control = run_on_ranks(_peak, 2, big_folder, "load_file", timeout_s=120)
    for r in ours + control:
        before, after = r["reset"]
        assert before * 1024 >= 60 * MiB and after * 1024 <= 2 * MiB, r["reset"]  # the reset works
    for r in ours:
        bound = 1.1 * (r["shard"] + r["largest"])
        assert 160 * MiB <= r["shard"] <= 161 * MiB and r["equal"]  # half the weights
        assert r["rise"] <= bound, (r["rise"] / MiB, bound / MiB)
        assert r["shard"] <= r["rchar"] <= r["shard"] + MiB, r["rchar"]
    for r in control:
        assert r["rise"] > 1.1 * (r["shard"] + r["largest"]), r["rise"] / MiB
        assert r["rchar"] < MiB  # mmap: nothing went through read()
    print(
        "peak rise MiB ours",
        [round(r["rise"] / MiB) for r in ours],
        "load_file",
        [round(r["rise"] / MiB) for r in control],
        "bound",
        round(1.1 * (ours[0]["shard"] + ours[0]["largest"]) / MiB),
        "| rchar MiB ours",
        [round(r["rchar"] / MiB, 2) for r in ours],
        "| read_bytes MiB ours",
        [round(r["read_bytes"] / MiB) for r in ours],
        "load_file",
        [round(r["read_bytes"] / MiB) for r in control],
    )


def test_a_pipefusion_stage_reads_only_its_blocks_without_mmap(tiny_folders):
    """loading.load_stage_transformer reads through load_weights: with safetensors' mmap refused it
    still loads (it never asks for a mapping), reads the stage's tensors and not the other stage's
    blocks (rchar), and holds them as safetensors' own reader returns them, under its own names."""
    from safetensors.torch import load_file

    from xdit_lab.lessons.loading import mmap_refused
    from xdit_lab.loading import load_stage_transformer

    folder = tiny_folders / "flux"
    saved = load_file(folder / "diffusion_pytorch_model.safetensors")
    before = _io()["rchar"]
    with mmap_refused() as refusals:  # Flux's stacked blocks 1, 2: double-stream block 1, single-stream block 0
        stage = load_stage_transformer(folder, "FluxTransformer2DModel", (1, 3), torch.float32, "cpu")
    rchar = _io()["rchar"] - before
    assert refusals == {"safe_open": 0, "load_file": 0}
    assert len(stage.transformer_blocks) == 1 and len(stage.single_transformer_blocks) == 1
    held = dict(stage.named_parameters())
    in_file = {  # the stage's double-stream block 0 is the file's block 1; every other name is the file's
        name: "transformer_blocks.1." + name.split(".", 2)[2] if name.startswith("transformer_blocks.") else name
        for name in held
    }
    assert all(torch.equal(t, saved[in_file[name]]) for name, t in held.items())
    stage_bytes = sum(t.numel() * 4 for t in held.values())
    assert stage_bytes < 0.75 * sum(t.numel() * 4 for t in saved.values())  # the double-stream blocks stay unread
    assert stage_bytes <= rchar <= stage_bytes + 64 * 1024, (rchar, stage_bytes)
