"""The embedded digits model: the trainer runs, the committed pipeline loads with stock diffusers
and draws the digit it is asked for, and the classifier that judges it reads real digits."""

import numpy as np
import pytest
import torch

pytest.importorskip("sklearn")

from diffusers import PixArtAlphaPipeline  # noqa: E402

from xdit_lab.digits import DIGITS_DIR, call_kwargs, classify, digit_accuracy, draw_digits, prompt_for, train_digits  # noqa: E402
from xdit_lab.digits.classifier import fit_classifier  # noqa: E402
from xdit_lab.digits.components import MAX_TOKENS, load_digit_images  # noqa: E402
from xdit_lab.digits.train import Recipe  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def test_training_smoke_run_saves_a_stock_pipeline(tmp_path):
    tiny = dict(steps=3, batch_size=16, log_every=0, recipe=Recipe(vae_steps=2))
    summary = train_digits(tmp_path, **tiny)
    assert summary["steps"] == 3 and np.isfinite(summary["final_loss"])
    assert summary["parameters"]["transformer"] > 1_000_000
    weights = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.safetensors"))
    assert weights == [
        "text_encoder/model.safetensors",
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]
    # Seeded: a second run with the same seed (and thread count) writes the same bytes.
    train_digits(tmp_path / "again", **tiny)
    for name in weights:
        assert (tmp_path / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name

    pipe = PixArtAlphaPipeline.from_pretrained(tmp_path)
    pipe.set_progress_bar_config(disable=True)
    image = pipe(
        prompt_for(3),
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **call_kwargs(num_inference_steps=2),
    ).images
    assert image.shape == (1, 16, 16, 3) and np.isfinite(image).all()


def test_prompts_and_null_caption_tokenize_as_trained():
    pipe = PixArtAlphaPipeline.from_pretrained(DIGITS_DIR)
    ids = pipe.tokenizer([prompt_for(7), ""], padding="max_length", max_length=MAX_TOKENS).input_ids
    vocab = pipe.tokenizer.get_vocab()
    assert ids[0][:4] == [vocab["a"], vocab["handwritten"], vocab["7"], vocab["</s>"]]
    assert ids[1][0] == vocab["</s>"]  # the negative prompt "" is the null caption of training
    assert pipe.tokenizer.unk_token_id not in ids[0]


def test_committed_model_draws_the_prompted_digits():
    pipe = PixArtAlphaPipeline.from_pretrained(DIGITS_DIR)  # stock diffusers, nothing of ours inside
    pipe.set_progress_bar_config(disable=True)
    digits = [d for d in range(10) for _ in range(5)]  # 50 images: seeds 0-4 for each digit
    seeds = [s for _ in range(10) for s in range(5)]
    images = draw_digits(pipe, digits, seeds)
    accuracy = digit_accuracy(images, digits)
    assert accuracy >= 0.9, (accuracy, classify(images).tolist())
    # Each image comes from its own generator, so one redrawn alone matches its place in the batch.
    alone = draw_digits(pipe, [7], [3])
    np.testing.assert_allclose(alone[0], images[7 * 5 + 3], atol=2e-3)


def test_classifier_reads_held_out_real_digits():
    # Fitted like the default classifier (on the data set's own 8 x 8 rows), but on 1300 digits
    # only; the other 497 are read the way generated images are: as 16 x 16 images, averaged back.
    from sklearn.datasets import load_digits

    data = load_digits()
    images, labels = load_digit_images()  # same order as `data`, [-1, 1]
    order = np.random.default_rng(0).permutation(len(labels))
    train, test = order[:1300], order[1300:]
    model = fit_classifier(data.data[train], data.target[train])
    assert digit_accuracy(images[test], labels[test].numpy(), model) > 0.95

    # The same image as torch [-1, 1], numpy [0, 1] HWC, uint8 and PIL reads as the same digit.
    from PIL import Image

    few = images[test[:8]]
    hwc = ((few.permute(0, 2, 3, 1).numpy() + 1) / 2).astype(np.float32)
    uint8 = (hwc * 255).round().astype(np.uint8)
    pil = [Image.fromarray(im) for im in uint8]
    expected = classify(few)
    for variant in (hwc, uint8, pil):
        assert (classify(variant) == expected).all()
