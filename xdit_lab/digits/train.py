"""Train the embedded digits model: a tiny PixArt-alpha pipeline that draws scikit-learn digits.

    python -m xdit_lab.digits.train --output DIR [--steps N] [--seed S] [--threads T]

Three stages, all on the 1797 digits of `sklearn.datasets.load_digits` (16 x 16, [-1, 1]):
1. The VAE learns to reconstruct the digits (a few hundred steps; a small KL weight keeps its
   latents smooth, so the decoder forgives the diffusion model's small errors).
2. The text encoder is a random T5 that stays frozen: it only has to give 11 distinct captions
   (ten digits and the null caption ""), and the transformer's caption projection learns to read
   them. Freezing it means the 11 embeddings are computed once, through the pipeline's own
   `encode_prompt`, so training sees exactly what inference will see (padding and mask included).
3. The transformer learns v-prediction on a squared-cosine schedule. v rather than epsilon:
   samplers estimate x0 = (x_t - sqrt(1-a) eps) / sqrt(a), and sqrt(a) is 5e-5 at t = 999, so
   an epsilon model's small errors become broken digits (12-17% read correctly after 500 steps,
   with any sampler); v gives x0 = sqrt(a) x_t - sqrt(1-a) v, bounded, and 20 (even 5)
   DPM-Solver++ steps draw as well as 100 DDPM steps. 10% of captions are replaced by the null
   caption so classifier-free guidance has an unconditional model to push away from.
The saved transformer weights are an exponential moving average of the optimiser's (the usual
choice for diffusion models, it smooths out the last steps' noise; not compared with the raw
weights here).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .components import (
    MAX_TOKENS,
    build_text_encoder,
    build_tokenizer,
    build_transformer,
    build_vae,
    load_digit_images,
    prompt_for,
)


@dataclass(frozen=True)
class Recipe:
    """Knobs that were tuned once (see assets/digits/README.md); train_digits' arguments are the rest."""

    prediction_type: str = "v_prediction"
    beta_schedule: str = "squaredcos_cap_v2"
    lr: float = 1e-3
    warmup_steps: int = 50
    ema_decay: float = 0.998
    caption_dropout: float = 0.1
    vae_steps: int = 300
    vae_batch_size: int = 64
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-3  # per latent element, against a per-pixel squared error
    sampler: str = "dpmsolver++"  # the scheduler saved with the pipeline (see make_scheduler)


def make_scheduler(kind: str, recipe: Recipe = Recipe()):
    """A sampling scheduler that matches the training noise schedule. kind: dpmsolver++ | ddim | ddpm | unipc | euler."""
    from diffusers import (
        DDIMScheduler,
        DDPMScheduler,
        DPMSolverMultistepScheduler,
        EulerDiscreteScheduler,
        UniPCMultistepScheduler,
    )

    common = dict(num_train_timesteps=1000, beta_schedule=recipe.beta_schedule, prediction_type=recipe.prediction_type)
    if kind == "dpmsolver++":
        return DPMSolverMultistepScheduler(**common, algorithm_type="dpmsolver++", solver_order=2)
    if kind == "unipc":
        return UniPCMultistepScheduler(**common)
    if kind == "ddim":
        return DDIMScheduler(**common, clip_sample=False, set_alpha_to_one=True)
    if kind == "euler":
        return EulerDiscreteScheduler(**common)
    if kind == "ddpm":
        return DDPMScheduler(**common, clip_sample=False)
    raise ValueError(f"unknown sampler {kind!r}")


def _train_vae(vae, images, recipe: Recipe, gen: torch.Generator) -> None:
    opt = torch.optim.AdamW(vae.parameters(), lr=recipe.vae_lr, weight_decay=0.0)
    for _ in range(recipe.vae_steps):
        batch = images[torch.randint(0, len(images), (recipe.vae_batch_size,), generator=gen)]
        posterior = vae.encode(batch).latent_dist
        z = posterior.sample(generator=gen)
        mse = F.mse_loss(vae.decode(z).sample, batch)
        loss = mse + recipe.vae_kl_weight * posterior.kl().mean() / z[0].numel()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    vae.eval().requires_grad_(False)


def _save_pipeline(pipe, folder) -> None:
    from .sample import CALL_DEFAULTS

    pipe.save_pretrained(folder, safe_serialization=True)
    # the call this model is made for travels with it: load_pipeline("digits") reads it
    (Path(folder) / "call_defaults.json").write_text(json.dumps(CALL_DEFAULTS, indent=2) + "\n")
    # transformers 5 records its fast tokenizer class as "TokenizersBackend", a name 4.x lacks;
    # "PreTrainedTokenizerFast" loads the same tokenizer.json in both.
    for name in ("model_index.json", "tokenizer/tokenizer_config.json"):
        path = Path(folder) / name
        path.write_text(path.read_text().replace('"TokenizersBackend"', '"PreTrainedTokenizerFast"'))


def train_digits(
    output_dir,
    *,
    steps: int = 1500,
    seed: int = 0,
    batch_size: int = 128,
    log_every: int = 100,
    threads: int | None = None,
    recipe: Recipe = Recipe(),
    checkpoints=(),
) -> dict:
    """Train the digits pipeline and save it (safetensors) to `output_dir`; returns a summary dict.

    Same seed, same thread count and same torch build give the same weights. `checkpoints` lists
    steps at which the current (EMA) pipeline is also saved to `output_dir/step-N`, to see how
    drawing quality grows with training.
    """
    from diffusers import PixArtAlphaPipeline

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        t_start = time.perf_counter()
        gen = torch.Generator().manual_seed(seed)
        images, labels = load_digit_images()

        # 1. VAE, then the (posterior) latents of every digit, scaled to unit variance.
        vae = build_vae(seed)
        _train_vae(vae, images, recipe, gen)
        with torch.no_grad():
            posterior = vae.encode(images).latent_dist
            lat_mean, lat_std = posterior.mean, posterior.std
            vae_mse = F.mse_loss(vae.decode(lat_mean).sample, images).item()
        scaling = 1.0 / (lat_mean + lat_std * torch.randn(lat_mean.shape, generator=gen)).std().item()
        vae.register_to_config(scaling_factor=scaling)
        t_vae = time.perf_counter() - t_start

        # 2. Frozen text encoder: embed the ten captions and the null caption once, as the pipeline would.
        text_encoder, tokenizer = build_text_encoder(seed), build_tokenizer()
        transformer = build_transformer(seed, caption_channels=text_encoder.config.d_model)
        pipe = PixArtAlphaPipeline(
            tokenizer=tokenizer,
            text_encoder=text_encoder,
            vae=vae,
            transformer=transformer,
            scheduler=make_scheduler(recipe.sampler, recipe),
        )
        with torch.no_grad():
            captions = [prompt_for(d) for d in range(10)] + [""]
            embeds, masks, _, _ = pipe.encode_prompt(
                captions,
                do_classifier_free_guidance=False,
                device="cpu",
                clean_caption=False,
                max_sequence_length=MAX_TOKENS,
            )
        null = 10

        # 3. The transformer, v- (or epsilon-) prediction with an EMA copy of its weights.
        noise_schedule = make_scheduler("ddpm", recipe)
        alphas_cumprod = noise_schedule.alphas_cumprod
        ema = {k: v.detach().clone() for k, v in transformer.state_dict().items()}
        opt = torch.optim.AdamW(transformer.parameters(), lr=recipe.lr, weight_decay=0.0)
        warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / recipe.warmup_steps))
        transformer.train()
        losses, t_loop = [], time.perf_counter()
        for step in range(1, steps + 1):
            idx = torch.randint(0, len(images), (batch_size,), generator=gen)
            x0 = (lat_mean[idx] + lat_std[idx] * torch.randn(lat_mean[idx].shape, generator=gen)) * scaling
            cap = labels[idx].clone()
            cap[torch.rand(batch_size, generator=gen) < recipe.caption_dropout] = null
            t = torch.randint(0, noise_schedule.config.num_train_timesteps, (batch_size,), generator=gen)
            noise = torch.randn(x0.shape, generator=gen)
            a = alphas_cumprod[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
            target = a.sqrt() * noise - (1 - a).sqrt() * x0 if recipe.prediction_type == "v_prediction" else noise
            pred = transformer(
                xt,
                encoder_hidden_states=embeds[cap],
                encoder_attention_mask=masks[cap],
                timestep=t,
                added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            ).sample
            loss = F.mse_loss(pred, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            warmup.step()
            # EMA with a short ramp, so early checkpoints are not dominated by the random init.
            decay = min(recipe.ema_decay, (1 + step) / (10 + step))
            with torch.no_grad():
                for k, v in transformer.state_dict().items():
                    ema[k].lerp_(v, 1 - decay)
            losses.append(loss.item())
            if log_every and (step % log_every == 0 or step == steps):
                recent = sum(losses[-log_every:]) / len(losses[-log_every:])
                print(f"step {step:5d}  loss {recent:.4f}  {time.perf_counter() - t_loop:6.0f} s", flush=True)
            if step in checkpoints or step == steps:
                live = {k: v.clone() for k, v in transformer.state_dict().items()}
                transformer.load_state_dict(ema)
                transformer.eval()
                target_dir = Path(output_dir) if step == steps else Path(output_dir) / f"step-{step}"
                _save_pipeline(pipe, target_dir)
                transformer.load_state_dict(live)
                transformer.train()

        seconds = time.perf_counter() - t_start
        import diffusers  # for the record: weights are reproducible for the same versions and threads

        summary = {
            "output_dir": str(output_dir),
            "steps": steps,
            "seed": seed,
            "batch_size": batch_size,
            "threads": torch.get_num_threads(),
            "seconds": round(seconds, 1),
            "vae_seconds": round(t_vae, 1),
            "seconds_per_step": round((time.perf_counter() - t_loop) / max(1, steps), 3),
            "torch": torch.__version__,
            "diffusers": diffusers.__version__,
            "vae_mse": round(vae_mse, 5),
            "scaling_factor": scaling,
            "final_loss": round(sum(losses[-100:]) / max(1, len(losses[-100:])), 5),
            "parameters": {
                name: sum(p.numel() for p in m.parameters())
                for name, m in [("transformer", transformer), ("vae", vae), ("text_encoder", text_encoder)]
            },
            "recipe": asdict(recipe),
        }
        (Path(output_dir) / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
    finally:
        torch.set_num_threads(old_threads)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Train the tiny digits PixArt pipeline.")
    parser.add_argument("--output", required=True, help="folder to write the diffusers pipeline to")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--checkpoints", type=int, nargs="*", default=())
    options = vars(parser.parse_args(argv))  # train_digits' keyword arguments, by the same names
    summary = train_digits(options.pop("output"), **dict(options, checkpoints=set(options["checkpoints"])))
    print(json.dumps({k: v for k, v in summary.items() if k != "recipe"}, indent=2))


if __name__ == "__main__":
    main()
