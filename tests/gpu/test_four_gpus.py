"""Four GPUs: the hybrid configurations through the CLI on NCCL against the serial run."""

import pytest
from gpu_tier import cli_args, cli_latents, digits_args, relative_error, torchrun

GPUS_NEEDED = 4
HYBRIDS = {
    "cfg2-ulysses2": ["--cfg", "2", "--ulysses", "2"],
    "ulysses2-ring2": ["--ulysses", "2", "--ring", "2"],
    "dp2-ring2": ["--dp", "2", "--ring", "2"],
    "cfg2-pipefusion2": ["--cfg", "2", "--pipefusion", "2"],
    "pipefusion2-ulysses2": ["--pipefusion", "2", "--ulysses", "2"],
}


@pytest.fixture(scope="module")
def serial(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrids")
    torchrun(1, digits_args(root / "serial"))
    return root, cli_latents(root / "serial")[0]


@pytest.mark.parametrize("hybrid", list(HYBRIDS))
def test_hybrid_equals_serial(hybrid, serial, figures):
    root, reference = serial
    extra = HYBRIDS[hybrid] + (["--warmup-steps", "4"] if "pipefusion" in hybrid else [])  # exact PipeFusion
    torchrun(4, digits_args(root / hybrid, *extra))
    latents, report = cli_latents(root / hybrid)
    figures(error=relative_error(latents, reference))
    assert {rank["device"] for rank in report["ranks"]} == {f"cuda:{i}" for i in range(4)}
    assert relative_error(latents, reference) <= 1e-4


def test_usp_with_joint_text_on_flux(tmp_path, figures):
    """Flux's joint text tokens under Ulysses inside Ring (text attended once, gathered over the ring)."""
    from xdit_lab.tiny import save_tiny_pipeline

    folder = save_tiny_pipeline("flux", tmp_path / "flux")
    torchrun(1, cli_args(folder, tmp_path / "serial", "flux"))
    torchrun(4, cli_args(folder, tmp_path / "usp", "flux", "--ulysses", "2", "--ring", "2"))
    error = relative_error(cli_latents(tmp_path / "usp")[0], cli_latents(tmp_path / "serial")[0])
    figures(error=error)
    assert error <= 1e-4
