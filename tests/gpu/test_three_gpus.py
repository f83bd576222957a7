"""Three GPUs: PipeFusion with 3 stages through the CLI on NCCL, where the middle stage both
receives and sends (the case whose message order models/pipefusion.py fixes)."""

from gpu_tier import cli_latents, digits_args, relative_error, relative_l2, torchrun

GPUS_NEEDED = 3


def test_pipefusion_three_stages(tmp_path, figures):
    torchrun(1, digits_args(tmp_path / "serial"))
    reference = cli_latents(tmp_path / "serial")[0]
    # every step synchronous: exact
    torchrun(3, digits_args(tmp_path / "exact", "--pipefusion", "3", "--warmup-steps", "4"))
    exact, report = cli_latents(tmp_path / "exact")
    # one warmup step, then patches read one-step-stale K/V (the approximation PipeFusion makes)
    torchrun(3, digits_args(tmp_path / "stale", "--pipefusion", "3"))
    stale = cli_latents(tmp_path / "stale")[0]
    figures(
        exact_error=relative_error(exact, reference),
        stale_rel_l2=relative_l2(stale, reference),
        stages_timings=str([round(sum(r["timings"]["steps"]), 3) for r in report["ranks"]]),
    )
    assert {rank["device"] for rank in report["ranks"]} == {"cuda:0", "cuda:1", "cuda:2"}
    assert relative_error(exact, reference) <= 1e-4
    assert relative_l2(stale, reference) < 0.05  # the bound measured on the digits model on CPU (README)
