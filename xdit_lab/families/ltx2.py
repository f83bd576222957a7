"""LTX-2: a video with its audio, drawn together. Gemma 3's every layer stacked, through LTX-2's text connectors
(one text for the video's blocks, one for the audio's), packed video latents [B, F·H·W, C] and packed audio latents
[B, L, C·M] (mel bins), two streams through every block, flow matching with the two latents stepped alike.

Each block runs, per stream, self-attention, cross-attention to its text, then the two streams attend to each
other, then a feed-forward:

    video (sharded)  attn1: video ↔ video                 sequence-parallel ("self")
                     attn2: video → its text               local ("cross": the text whole on every rank)
                     audio_to_video_attn: video → audio    local ("cross": the audio whole on every rank)
    audio (whole)    audio_attn1, audio_attn2              as diffusers wrote them ("text": whole on every rank)
                     video_to_audio_attn: audio → video    "whole_queries": each rank attends to its video keys,
                                                           the partials merged by their LSE over the sp ranks

The video's tokens follow their shard; the audio is kept whole on every rank, for two reasons. It is short (25
latent frames a second: 121 frames at 24 fps are 126 audio tokens beside 16 × 16 × 24 = 6,144 video tokens at 512
× 768), so every rank computing all of it costs little; and its blocks read the whole video through
video_to_audio_attn, which sharded audio would make a second sequence-parallel exchange per block (the audio's
queries and the video's keys in one Ulysses all-to-all, or a Ring over the video) where whole audio moves only the
audio-sized partial outputs [B, H, L, D + 1] of every rank (attention/usp.py: whole_query_attention). Every rank
then holds the same audio after every block, and returns the whole audio prediction, which cfg and dp gather
beside the video's. The rotary tables of the video (`rope`, and `cross_attn_rope`'s for its audio attention) are
cut with its tokens; the audio's stay whole.

diffusers' `_cp_plan` gives where the video is gathered (proj_out) and its rotary tables (rope); it also cuts the
text, which its context parallelism attends sequence-parallel: here no attention is joint, the cross-attention's
text stays whole and local, and the plan's text cut is never used.

LTX2Pipeline, text to video with its audio. Per step it runs the batch [negative; positive] in one forward (which
cfg 2 splits), each stream guided as the pipeline guides it: in x0 (latents − v·σ), scaled by guidance_scale and
audio_guidance_scale (None or 0: the video's), rescaled by guidance_rescale and audio_guidance_rescale, back to a
velocity; the two latents stepped by the scheduler and by a copy of it, as the pipeline does. The video's latents
are kept unpacked [B, C, F, H, W] between steps (VIDEO's layout), packed into tokens for the forward: the
scheduler's step and the guidance are elementwise (the rescale's std over every element), so this is the
pipeline's arithmetic. Refused by name: spatio-temporal guidance (stg_scale, audio_stg_scale above 0) and
modality-isolation guidance (modality_scale, audio_modality_scale above 1), which the pipeline's defaults turn on
and which run extra forwards of their own (a perturbed one, one without the audio-video attention): give
stg_scale=0, audio_stg_scale=0, modality_scale=1, audio_modality_scale=1. StepCache: below.

PipeFusion. A stage runs its blocks once per video patch (a band of token rows, the frames stacked as rows), the
audio whole in every run, diffusers' blocks unchanged; the audio rides with each patch as other families' joint
text does (adapter.BesideStream, in the text's place), and the last stage's last patch gives both predictions:

    stage 0 ── patch p: video [B, S_p, C] + audio [B, L, C_audio] ──▶ stage 1       (every patch of every step)
    block b, patch p (P patches):
      attn1                video_p ↔ video of every patch: kept K/V (patches < p this step's, > p the step before's)
      audio_to_video_attn  video_p → the audio of this run (local: it came with the patch)
      video_to_audio_attn  audio → video of every patch: kept K/V as attn1's, each sp rank its own tokens, the
                           partials merged as under sequence shards ("whole_queries")
      audio_attn1/2        the audio alone, whole

A warm-up step holds every patch in one run: diffusers' forward, exact. After it the audio of run p has read
patches < p as they were computed this step (from their own runs' audio) and patches > p from the step before;
the audio of the last patch's run is the prediction. Handing the audio with every patch, rather than running it
once a step after the last patch, costs its L tokens' blocks P times (126 audio tokens beside 6,144 video ones at
the defaults) and L × C_audio per patch on the link, and keeps diffusers' block whole (its two streams interleave
inside every block). The async schedule, which steps the video's latents patch by patch, is refused.

Decoding: the video VAE decodes in row bands over the ranks that share a video, as the other video VAEs do
(vae.py: its convolutions reflect their rows, the halo rows joining the band first; vae.ltx2_halo_bytes counts
them), each dp and cfg rank its own videos; the audio VAE and the vocoder decode each video's audio once, whole,
on every rank (a few hundred latent frames: no bands to cut)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
from dataclasses import dataclass

import numpy as np
import torch

from .adapter import BesideStream, FamilyAdapter, RotaryLayout, VideoLatents
from .recipe import Request, VideoRecipe, generator_of
from .tiny_spec import INNER, MAX_TOKENS, TEXT_DIM, Part, TinySpec


@dataclass(frozen=True)
class PackedVideo(VideoLatents):
    """VIDEO's [B, C, F, H, W] as the recipe keeps the latents between steps; the forward takes them packed,
    [B, F·H·W, C] (frame-major, the same token order), its grid given by its num_frames, height and width."""

    def token_grid(self, latents, model_config, arguments):
        if latents.dim() == 3:
            pt, ph, pw = self.video_patch(model_config)
            return arguments["num_frames"] // pt * (arguments["height"] // ph), arguments["width"] // pw
        return super().token_grid(latents, model_config, arguments)

    def prediction_shape(self, latents, model_config):
        if latents.dim() == 3:  # packed: the channels last (a PipeFusion stage's receive buffer)
            return (*latents.shape[:2], model_config.get("out_channels") or model_config["in_channels"])
        return super().prediction_shape(latents, model_config)


@dataclass(frozen=True)
class BatchedRotary(RotaryLayout):
    """(cos, sin) of the video's tokens with a batch dimension: [B, S, D] (interleaved rotary) or [B, H, S, D / 2]
    (split rotary), the tokens on the second dimension from the end."""

    def keep_rows(self, tables, text, keep, keep_text=None):
        return tuple(keep(t, t.dim() - 2) for t in tables)


def audio_tokens(arguments: dict) -> int:
    """The audio's tokens, whole on every rank: the queries of the video-to-audio attention."""
    return arguments["audio_hidden_states"].shape[1]


STEP_CACHE_REFUSED = (
    "diffusers' First-Block Cache, the reference it is checked against, reads one stream of states from each block, "
    "and LTX-2's blocks return two (the video's and the audio's)"
)


def audio_width(model_config) -> int:
    """The audio's features between blocks (its attention's heads × head_dim)."""
    return model_config["audio_num_attention_heads"] * model_config["audio_attention_head_dim"]


ADAPTER = FamilyAdapter(
    "ltx2",
    "LTX2VideoTransformer3DModel",
    shard_at="proj_in",
    attention={
        r"^transformer_blocks\.\d+\.attn1$": "self",
        r"^transformer_blocks\.\d+\.attn2$": "cross",
        r"^transformer_blocks\.\d+\.audio_to_video_attn$": "cross",
        r"^transformer_blocks\.\d+\.audio_attn[12]$": "text",
        r"^transformer_blocks\.\d+\.video_to_audio_attn$": "whole_queries",
    },
    latents=PackedVideo(),
    rotary=BatchedRotary(),
    rotary_also=("cross_attn_rope",),
    whole_query_len=audio_tokens,
    step_cache_refused=STEP_CACHE_REFUSED,
    # PipeFusion: a block returns (video, audio), and a stage hands the audio on with each video patch
    block_returns={
        "LTX2VideoTransformerBlock": dict(
            return_hidden_states_index=0,
            return_encoder_hidden_states_index=1,
            hidden_states_argument_name="hidden_states",
            encoder_hidden_states_argument_name="audio_hidden_states",
        )
    },
    beside=BesideStream("audio_hidden_states", audio_width),
    # from its _cp_plan (cp_plan.py): gathered at proj_out, the rotary tables at rope
    from_cp_plan=True,
    tp_refused="its audio stream's layers run on the audio's tokens beside the video's, which the closed form of "
    "tp's traffic does not count yet",
)

AUDIO_DOWNSAMPLE = 4  # the audio VAE's in time and in mel bins (AutoencoderKLLTX2Audio's LATENT_DOWNSAMPLE_FACTOR)
GUIDANCE_OFF = dict(stg_scale=0.0, audio_stg_scale=0.0, modality_scale=1.0, audio_modality_scale=1.0)


class LTX2Recipe(VideoRecipe):
    pipeline_classes = ("LTX2Pipeline",)
    output_class = "diffusers.pipelines.ltx2.pipeline_output:LTX2PipelineOutput"
    default_size = (512, 768)  # LTX2Pipeline's
    defaults = dict(num_inference_steps=30, guidance_scale=3.0)
    step_cache_refused = dict.fromkeys(pipeline_classes, STEP_CACHE_REFUSED)
    latents_beside = ("audio_latents",)  # the audio's, stepped with the video's
    # the pipeline's own defaults (its STG and modality guidance on: refused until given as GUIDANCE_OFF)
    options = dict(
        num_frames=121, frame_rate=24.0, motion_speed=1.0, max_sequence_length=1024, guidance_rescale=0.7,
        audio_guidance_scale=7.0, audio_guidance_rescale=0.7, stg_scale=1.0, audio_stg_scale=1.0, modality_scale=3.0,
        audio_modality_scale=3.0, use_cross_timestep=True, noise_scale=0.0, decode_timestep=0.0,
        decode_noise_scale=None,
    )  # fmt: skip

    def check_inputs(self, pipe, request):
        height, width = self.size(request)
        if height % 32 or width % 32:
            raise ValueError(f"{type(pipe).__name__} draws heights and widths divisible by 32, not {height} × {width}")
        on = {key: request.options[key] for key in GUIDANCE_OFF if _guidance_on(key, request.options)}
        if on:
            raise NotImplementedError(
                f"{type(pipe).__name__} with {', '.join(f'{k}={v}' for k, v in on.items())} runs spatio-temporal or "
                f"modality-isolation guidance, each an extra forward of its own (a perturbed one, one without the "
                f"audio-video attention), which xdit_lab does not run; classifier-free guidance runs: give "
                f"{', '.join(f'{k}={v}' for k, v in GUIDANCE_OFF.items())} (in the call, or in the folder's "
                f"call_defaults.json)"
            )

    def check_pipeline(self, pipe):
        if getattr(pipe, "duration_head", None) is not None or pipe.transformer.config.use_keyframes_abs_pos_embedding:
            raise NotImplementedError(
                f"{type(pipe).__name__} of an LTX-2.5 folder (a duration head, keyframe embeddings) is not run by "
                f"xdit_lab: its duration head picks num_frames, which xdit_lab's calls give (121 by default); "
                f"folders without either run"
            )

    def do_cfg(self, request: Request) -> bool:  # the pipeline's: either stream guided
        return request.guidance_scale > 1.0 or _audio(request, "audio_guidance_scale", request.guidance_scale) > 1.0

    def size_multiple(self, pipe):  # a token's pixels (LTX2Pipeline also asks for multiples of 32: check_inputs)
        return pipe.vae_spatial_compression_ratio * pipe.transformer.config.patch_size, self.default_size

    def token_frames(self, pipe, request):
        frames = (request.options["num_frames"] - 1) // pipe.vae_temporal_compression_ratio + 1
        return frames // pipe.transformer.config.patch_size_t

    def token_budget(self, pipe, request):
        return request.options["max_sequence_length"]

    def prompt_tokens(self, pipe, request, text):
        return super().prompt_tokens(pipe, request, text.strip())  # the pipeline strips each prompt

    def encode_texts(self, pipe, request, texts, device, *, negative):
        # Gemma's stacked layers, then the connectors (the pipeline runs them on [negative; positive] together:
        # per sample, so branch by branch is the same)
        embeds, mask, _, _ = pipe.encode_prompt(
            texts, do_classifier_free_guidance=False, max_sequence_length=request.options["max_sequence_length"],
            device=device,
        )  # fmt: skip
        padding_side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, mask = pipe.connectors(embeds, mask, padding_side=padding_side)
        return dict(encoder_hidden_states=video, audio_encoder_hidden_states=audio, encoder_attention_mask=mask)

    def prepare(self, pipe, request, prepared, device):
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        options, rows = request.options, len(request.prompts)
        height, width = self.size(request)
        frames = options["num_frames"]
        generator = generator_of(request)  # one generator: the video's noise, the audio's, the decode's
        packed = pipe.prepare_latents(
            rows, pipe.transformer.config.in_channels, height, width, frames, options["noise_scale"], torch.float32,
            device, generator,
        )  # fmt: skip
        seconds = frames / options["frame_rate"]
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        audio_frames, mel_bins = round(seconds * per_second), pipe.audio_vae.config.mel_bins
        audio = pipe.prepare_audio_latents(
            rows, num_channels_latents=pipe.audio_vae.config.latent_channels, audio_latent_length=audio_frames,
            num_mel_bins=mel_bins, noise_scale=options["noise_scale"], dtype=torch.float32, device=device,
            generator=generator,
        )  # fmt: skip
        steps = request.num_inference_steps
        sigmas = np.linspace(1.0, 1 / steps, steps)
        config = pipe.scheduler.config
        mu = calculate_shift(
            packed.shape[1], config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.95), config.get("max_shift", 2.05),
        )  # fmt: skip
        audio_scheduler = copy.deepcopy(pipe.scheduler)  # the pipeline's copy for the audio, stepped alike
        retrieve_timesteps(audio_scheduler, steps, device, None, sigmas=sigmas, mu=mu)
        prepared.timesteps, _ = retrieve_timesteps(pipe.scheduler, steps, device, None, sigmas=sigmas, mu=mu)
        pipe.scheduler.set_begin_index(0)
        audio_scheduler.set_begin_index(0)
        grid = (
            (frames - 1) // pipe.vae_temporal_compression_ratio + 1,
            height // pipe.vae_spatial_compression_ratio,
            width // pipe.vae_spatial_compression_ratio,
        )
        fps = conditioning_frame_rate(options["frame_rate"], options["motion_speed"])
        prepared.latents = _unpacked(pipe, packed, grid)
        prepared.extra.update(
            options=options,  # the guidance and decode settings the steps and the decode read
            audio_latents=audio,
            audio_scheduler=audio_scheduler,
            generator=generator,
            grid=grid,
            audio_frames=audio_frames,
            fps=fps,
            video_coords=pipe.transformer.rope.prepare_video_coords(rows, *grid, device, fps=fps),
            audio_coords=pipe.transformer.audio_rope.prepare_audio_coords(rows, audio_frames, device),
        )

    def model_input(self, pipe, prepared, latents, t):
        config = pipe.transformer.config
        packed = pipe._pack_latents(latents, config.patch_size, config.patch_size_t)
        return super().model_input(pipe, prepared, packed, t)

    def model_kwargs(self, pipe, prepared, model_input, t):
        extra, text = prepared.extra, prepared.conditioning
        branches = 2 if prepared.do_cfg else 1
        audio = torch.cat([extra["audio_latents"]] * branches).to(model_input.dtype)
        timestep = t.expand(model_input.shape[0])
        frames, height, width = extra["grid"]
        return dict(
            hidden_states=model_input,
            audio_hidden_states=audio,
            encoder_hidden_states=text["encoder_hidden_states"],
            audio_encoder_hidden_states=text["audio_encoder_hidden_states"],
            timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=text["encoder_attention_mask"],
            audio_encoder_attention_mask=text["encoder_attention_mask"],
            num_frames=frames,
            height=height,
            width=width,
            fps=extra["fps"],
            audio_num_frames=extra["audio_frames"],
            video_coords=extra["video_coords"].repeat(branches, 1, 1, 1),
            audio_coords=extra["audio_coords"].repeat(branches, 1, 1, 1),
            isolate_modalities=False,
            use_cross_timestep=extra["options"]["use_cross_timestep"],
            return_dict=False,
        )

    def prediction(self, pipe, prepared, output):
        video, audio = output
        prepared.extra["audio_noise"] = audio.float()
        return _unpacked(pipe, video.float(), prepared.extra["grid"])

    def guide(self, pipe, prepared, noise, step_index):
        extra = prepared.extra
        options = extra["options"]
        video_scale = prepared.guidance_scale
        audio_scale = options["audio_guidance_scale"] or video_scale
        audio_rescale = options["audio_guidance_rescale"] or options["guidance_rescale"]
        extra["audio_noise"] = _guided(
            extra["audio_scheduler"], extra["audio_latents"], extra["audio_noise"], step_index, audio_scale,
            audio_rescale, prepared.do_cfg,
        )  # fmt: skip
        return _guided(
            pipe.scheduler, prepared.latents, noise, step_index, video_scale, options["guidance_rescale"],
            prepared.do_cfg,
        )  # fmt: skip

    def scheduler_step(self, pipe, prepared, noise, t, latents, step_index):
        extra = prepared.extra
        extra["audio_latents"] = extra["audio_scheduler"].step(
            extra["audio_noise"], t, extra["audio_latents"], return_dict=False
        )[0]
        return pipe.scheduler.step(noise, t, latents, return_dict=False)[0]

    def decode(self, pipe, prepared, latents, output_type):
        """(the video's frames, the audio's waveform), as LTX2Pipeline returns them: with output_type "latent",
        the video's latents denormalized and the audio's unpacked [B, C, L, M]."""
        vae, audio_vae, options = pipe.vae, pipe.audio_vae, prepared.extra["options"]
        audio = pipe._denormalize_audio_latents(
            prepared.extra["audio_latents"], audio_vae.latents_mean, audio_vae.latents_std
        )
        audio = pipe._unpack_audio_latents(
            audio,
            prepared.extra["audio_frames"],
            num_mel_bins=audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio,
        )
        if output_type == "latent":
            return pipe._denormalize_latents(
                latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
            ), audio
        latents = latents.to(pipe.transformer.dtype)
        temb = None
        if vae.config.timestep_conditioning:  # the pipeline's decode noise, from the generator the latents used
            from diffusers.utils.torch_utils import randn_tensor

            rows = len(latents)
            noise = randn_tensor(
                latents.shape, generator=prepared.extra["generator"], device=latents.device, dtype=latents.dtype
            )
            timestep, scale = options["decode_timestep"], options["decode_noise_scale"]
            timestep = timestep if isinstance(timestep, list) else [timestep] * rows
            scale = timestep if scale is None else scale if isinstance(scale, list) else [scale] * rows
            temb = torch.tensor(timestep, device=latents.device, dtype=latents.dtype)
            scale = torch.tensor(scale, device=latents.device, dtype=latents.dtype)[:, None, None, None, None]
            latents = (1 - scale) * latents + scale * noise
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = vae.decode(latents.to(vae.dtype), temb=temb, return_dict=False)[0]
        video = pipe.video_processor.postprocess_video(video, output_type=output_type)
        # the audio VAE and the vocoder: each video's audio once, whole, on every rank
        mel = audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0]
        return video, pipe.vocoder(mel)

    def wrap_output(self, images):
        module, name = self.output_class.split(":")
        video, audio = images
        return getattr(importlib.import_module(module), name)(frames=video, audio=audio)

    def output_tuple(self, images) -> tuple:
        return tuple(images)  # (video, audio), as LTX2Pipeline returns them with return_dict=False

    def planned_request(self, configs, call, element):
        # VideoRecipe's video latents and grid, and the audio's latents beside them (float32, as the pipeline keeps
        # them): the latent frames of num_frames / frame_rate seconds, latent channels × latent mel bins a frame
        shape = super().planned_request(configs, call, element)
        audio = configs["audio_vae"]
        per_second = audio.get("sample_rate", 16000) / audio.get("mel_hop_length", 160) / AUDIO_DOWNSAMPLE
        frames = round(call.options["num_frames"] / call.options["frame_rate"] * per_second)
        features = audio.get("latent_channels", 8) * (audio.get("mel_bins", 64) // AUDIO_DOWNSAMPLE)
        return dataclasses.replace(shape, latents_per_prompt=shape.latents_per_prompt + frames * features * 4)

    def planned_text_bytes(self, transformer, call, element):
        # the connectors' video and audio texts (caption_channels wide each, LTX-2.0's; LTX-2.3's as wide as each
        # stream's cross-attention) and their int64 mask, max_sequence_length tokens each
        if transformer.get("use_prompt_embeddings", True):
            widths = 2 * transformer.get("caption_channels", 3840)
        else:
            widths = transformer.get("cross_attention_dim", 4096) + transformer.get("audio_cross_attention_dim", 2048)
        return call.options["max_sequence_length"] * (widths * element + 8)


RECIPE = LTX2Recipe()


def _audio(request: Request, key: str, video_value):
    """An audio setting as the pipeline reads it: its own, or the video's where None or 0 (`value or video's`)."""
    return request.options[key] or video_value


def _guidance_on(key: str, options: dict) -> bool:
    """Whether a spatio-temporal or modality guidance scale runs its extra forward (the pipeline's do_ properties,
    the audio's falling back to the video's where None or 0)."""
    value = options[key]
    if key.startswith("audio_"):
        value = value or options[key.removeprefix("audio_")]
    return value > 0.0 if "stg" in key else value > 1.0


def _unpacked(pipe, packed, grid):
    """[B, F·H·W, C] -> [B, C, F, H, W], the pipeline's _unpack_latents."""
    config = pipe.transformer.config
    return pipe._unpack_latents(packed, *grid, config.patch_size, config.patch_size_t)


def _guided(scheduler, latents, noise, step_index, scale, rescale, do_cfg):
    """The pipeline's guidance of one stream: in x0 (latents − v·σ), cond + (scale − 1)·(cond − uncond), rescaled
    towards cond's std by `rescale`, back to a velocity."""
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    sigma = scheduler.sigmas[step_index]
    if do_cfg:
        uncond, cond = (latents - v * sigma for v in noise.chunk(2))
        guided = cond + (scale - 1) * (cond - uncond)
    else:
        cond = guided = latents - noise * sigma
    if rescale > 0:
        guided = rescale_noise_cfg(guided, cond, guidance_rescale=rescale)
    return (latents - guided) / sigma


def tiny_inputs(batch, height, width, text, timestep, randn):
    """Two latent frames packed into tokens, 5 audio frames (2 latent channels × 2 mel bins a token), the same text
    for both streams with a padding mask (a different length per sample)."""
    frames, audio = 2, 5
    mask = torch.ones(batch, text.shape[1])
    mask[0, : text.shape[1] // 2] = 0  # left padding, as Gemma's tokenizer pads here
    return dict(
        hidden_states=randn(batch, frames * height * width, 4),
        audio_hidden_states=randn(batch, audio, 4),
        encoder_hidden_states=text,
        audio_encoder_hidden_states=randn(*text.shape),
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        timestep=timestep,
        num_frames=frames,
        height=height,
        width=width,
        audio_num_frames=audio,
    )


TINY = TinySpec(
    transformer=dict(
        in_channels=4, out_channels=4, cross_attention_dim=INNER, audio_in_channels=4, audio_out_channels=4,
        audio_num_attention_heads=2, audio_attention_head_dim=8, audio_cross_attention_dim=16,
        caption_channels=TEXT_DIM, rope_type="split", vae_scale_factors=(4, 4, 4),
    ),
    inputs=tiny_inputs,
    pipeline_classes=("LTX2Pipeline",),
    parts=dict(
        text_encoder=Part("gemma3_encoder", seed=1, vocab_of="tokenizer"),
        tokenizer=Part("gemma_tokenizer"),
        connectors=Part("ltx2_connectors", seed=3),
        vae=Part("ltx2_vae", seed=2, kwargs=dict(latent_channels=4)),
        audio_vae=Part("ltx2_audio_vae", seed=4),
        vocoder=Part("ltx2_vocoder", seed=5),
        scheduler=Part("FlowMatchEulerDiscreteScheduler"),
    ),
    # 5 frames of 32 × 32 (4x): 2 latent frames of 8 × 8, 128 video tokens; 0.2 s of audio at 25 fps: 5 tokens
    call=dict(height=32, width=32, num_frames=5, frame_rate=25.0, max_sequence_length=MAX_TOKENS, **GUIDANCE_OFF),
)  # fmt: skip
