"""One GPU: offloaded blocks (load_pipeline(offload_blocks=N), diffusers' group offloading after parallelize) where
the device is not the host, which a CPU cannot show (tests/test_offload.py checks the rest there):

  - the load never holds the transformer whole on the GPU: its peak allocated during the load stays under the
    transformer's bytes (the control: the same load without offloading holds at least them);
  - while a block runs, the transformer's weights on the GPU are exactly diffusers' root group and that block's
    group, as the plan counts them; between steps none of them is on the GPU;
  - the latents equal the same load's without offloading (float32, the same kernels on the same data).
"""

import torch

GPUS_NEEDED = 1
BLOCKS = 1


def _stored_on_gpu(transformer) -> int:
    """Bytes of the transformer's parameters and persistent buffers now on the GPU (what the plan counts)."""
    return sum(t.nbytes for t in transformer.state_dict(keep_vars=True).values() if t.device.type == "cuda")


def _load(folder, offload):
    from xdit_lab import load_pipeline

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    pipe = load_pipeline(folder, torch_dtype=torch.float32, progress=False, offload_blocks=offload)
    return pipe, torch.cuda.max_memory_allocated() - before


def test_offloaded_blocks_come_to_the_gpu_one_group_at_a_time(tmp_path, figures):
    from xdit_lab.lessons.families import output_latents
    from xdit_lab.models import offload_groups
    from xdit_lab.tiny import save_tiny_pipeline, tiny_pipeline_kwargs

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    call = dict(tiny_pipeline_kwargs("flux"), num_inference_steps=3, seed=0)
    plain, plain_peak = _load(folder, None)
    whole = plain.memory_plan.component_bytes["transformer"]
    expected = output_latents(plain.session(["a red cat"], **call).run().result(output_type="latent"))
    del plain
    pipe, peak = _load(folder, BLOCKS)
    transformer = pipe.diffusers_pipeline.transformer
    groups = offload_groups(transformer)
    root = groups[-1].bytes
    seen = {}  # block group -> the transformer's bytes on the GPU while one of its blocks runs

    def note(group):
        def hook(*_):
            seen[group.blocks] = _stored_on_gpu(transformer)

        return hook

    # a hook on a block's first child runs inside diffusers' forward of the block: its group is onloaded there
    handles = [
        next(iter(group.leader.children())).register_forward_pre_hook(note(group)) for group in groups if group.blocks
    ]
    session = pipe.session(["a red cat"], **call)
    between = []
    for _ in range(call["num_inference_steps"]):
        session.step()
        between.append(_stored_on_gpu(transformer))
    latents = output_latents(session.result(output_type="latent"))
    for handle in handles:
        handle.remove()
    figures(load_peak=peak, plain_load_peak=plain_peak, transformer=whole, root=root)
    assert plain_peak >= whole  # the control: loaded to the GPU whole
    assert peak < whole, f"the offloaded load peaked at {peak} bytes, the transformer is {whole}"
    assert between == [0] * call["num_inference_steps"]
    assert seen == {g.blocks: root + g.bytes for g in groups if g.blocks}
    assert max(seen.values()) == pipe.memory_plan.per_rank_bytes["transformer"]
    error = ((latents - expected).abs().max() / expected.abs().max()).item()
    figures(error=error)
    assert latents.device.type == "cuda" and error <= 1e-6
