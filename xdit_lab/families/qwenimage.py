"""Qwen-Image: a Qwen2.5-VL text encoder, packed 2×2 latent tokens, joint attention with the text first
over padded text (masked), true CFG with a norm-preserving rescale, flow matching.

diffusers' QwenImagePipeline encodes the prompts and the negative prompts apart, each padded to its
own longest prompt with a mask (None when nothing is padded), and runs the negative branch as a
second forward. Here both branches go in one batch [negative; positive], which cfg 2 then splits:
their text is padded to one length with the mask extended (`padded_text`), which the transformer's
masked attention makes exact, and the session pads every rank's rows to the longest over the ranks
before it gathers them. The parallel kernels take the mask as a key mask over the text alone."""

from __future__ import annotations

import torch

from .adapter import IMAGE_AND_TEXT, TOKENS, FamilyAdapter
from .recipe import PackedLatentsRecipe, RequestShape, TrueCFGRecipe, causal_vae_decoded, prompt_embeds
from .tiny_spec import TEXT_DIM, Part, TinySpec, flow_scheduler

ADAPTER = FamilyAdapter(
    "qwenimage",
    "QwenImageTransformer2DModel",
    shard_at="img_in",
    attention={r"^transformer_blocks\.\d+\.attn$": "joint_first"},
    latents=TOKENS,
    rotary=IMAGE_AND_TEXT,
    # from its _cp_plan (cp_plan.py): the rotary tables at pos_embed, the text and its key mask as block 0 takes
    # them, and Qwen-Image-Edit-2511's modulate_index (zero_cond_t: which image of the sample each token is of),
    # built whole by the forward and handed to every block, cut with the tokens
    from_cp_plan=True,
    per_sample_lists=("img_shapes",),
)


class QwenImageRecipe(PackedLatentsRecipe, TrueCFGRecipe):
    pipeline_classes = ("QwenImagePipeline",)
    output_class = "diffusers.pipelines.qwenimage.pipeline_output:QwenImagePipelineOutput"
    defaults = dict(num_inference_steps=50, guidance_scale=None)  # guidance_scale: a distilled model's input
    options = dict(true_cfg_scale=4.0, max_sequence_length=512)
    longest_text = 1024  # QwenImagePipeline.check_inputs
    counted_with = " with the template's closing tokens"

    def prompt_tokens(self, pipe, request, text):
        # the prompt in its template, less the template's opening the pipeline crops (its closing tokens count)
        ids = pipe.tokenizer(pipe.prompt_template_encode.format(text)).input_ids
        return len(ids) - pipe.prompt_template_encode_start_idx

    padded_text = ("encoder_hidden_states", "encoder_hidden_states_mask")

    def encode_texts(self, pipe, request, texts, device, *, negative):
        embeds, mask = prompt_embeds(pipe, request, texts, device)
        if mask is None:  # diffusers drops a mask that masks nothing; a batch of two branches needs one
            mask = torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
        return dict(encoder_hidden_states=embeds, encoder_hidden_states_mask=mask.bool())

    def prepare(self, pipe, request, prepared, device):
        prepared.latents = self.packed_latents(pipe, request, prepared, device)
        height, width = prepared.extra["size"]
        prepared.extra["image_shape"] = (1, height // pipe.vae_scale_factor // 2, width // pipe.vae_scale_factor // 2)
        if pipe.transformer.config.guidance_embeds and request.guidance_scale is None:
            raise ValueError("this Qwen-Image model is guidance-distilled: give guidance_scale")
        mu = self.image_tokens_shift(pipe, prepared.latents.shape[1])
        self.set_timesteps(pipe, request, prepared, device, mu, flow_sigmas=False)

    def planned_request(self, configs, call, element):
        rows, cols, latents = self.packed_grid(configs, call, element)
        text = call.options["max_sequence_length"]
        per_row = text * (configs["transformer"]["joint_attention_dim"] * element + 1)  # states and the bool mask
        why = (
            f"conditioning: at most max_sequence_length {text} text tokens a row; Qwen-Image pads a batch to its "
            f"longest prompt, whose length is known only once it is tokenized"
        )
        return RequestShape(latents, per_row, 0, (rows, cols), None, bounds=(why,))

    def model_kwargs(self, pipe, prepared, model_input, t):
        image_shapes = [[prepared.extra["image_shape"]]] * model_input.shape[0]
        return dict(super().model_kwargs(pipe, prepared, model_input, t), img_shapes=image_shapes)

    def guide(self, pipe, prepared, noise, step_index):
        """True CFG, rescaled to the conditional prediction's norm per token, as QwenImagePipeline does."""
        if not prepared.do_cfg:
            return noise
        uncond, cond = noise.chunk(2)
        guided = uncond + prepared.guidance_scale * (cond - uncond)
        return guided * (torch.norm(cond, dim=-1, keepdim=True) / torch.norm(guided, dim=-1, keepdim=True))

    def decoded(self, pipe, prepared, latents):
        height, width = prepared.extra["size"]
        latents = pipe._unpack_latents(latents, height, width, pipe.vae_scale_factor)
        return causal_vae_decoded(pipe, latents)[:, :, 0]  # one frame


RECIPE = QwenImageRecipe()


def padded_text_mask(batch: int, text_len: int) -> torch.Tensor:
    """[batch, text_len] bool: each sample's text a different length (0 to 2 padded tokens), as a batch pads it."""
    return torch.arange(text_len)[None, :] < (text_len - torch.arange(batch) % 3)[:, None]


def tiny_inputs(batch, height, width, text, timestep, randn):
    """2 × 2 latent pixels packed per token; padded text, a different length per sample."""
    grid = (1, height // 2, width // 2)
    return dict(
        hidden_states=randn(batch, grid[1] * grid[2], 16),
        encoder_hidden_states=text,
        encoder_hidden_states_mask=padded_text_mask(batch, text.shape[1]),
        timestep=timestep / 1000,
        img_shapes=[[grid]] * batch,
    )


TINY = TinySpec(  # modelled on diffusers' own test of QwenImageTransformer2DModel
    transformer=dict(
        patch_size=2, in_channels=16, out_channels=4, joint_attention_dim=TEXT_DIM, axes_dims_rope=(8, 4, 4)
    ),
    inputs=tiny_inputs,
    pipeline_classes=("QwenImagePipeline",),
    parts=dict(  # 2 × 2 patches of 4 latent channels packed into 16
        text_encoder=Part("qwen_vl_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("qwen_tokenizer"),
        vae=Part("qwen_vae", seed=2, kwargs=dict(latent_channels=4)),
        scheduler=flow_scheduler(shift=1.0, max_shift=0.9, max_image_seq_len=8192, time_shift_type="exponential"),
    ),
    # an 8 × 8 latent: 4 × 4 tokens; the text as long as each prompt encodes, padded and masked in a batch
    call=dict(height=32, width=32),
)
