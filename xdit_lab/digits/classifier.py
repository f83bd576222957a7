"""An independent judge of generated digits: an SVC fitted on scikit-learn's real 8 x 8 digits.

It shares nothing with the generator but the data set, so "the classifier reads the prompted
digit" is a fair test that a pipeline (serial or parallel) still draws what it was asked to.
Generated images of any size are brought to the data set's form first: grey, averaged down to
8 x 8, scaled to 0-16 with ink high.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F

from .components import as_numpy_images


def to_digit_features(images) -> np.ndarray:
    """Images (PIL / numpy / torch, [0, 1] or [-1, 1]) -> `[N, 64]` features on the 0-16 scale."""
    x = torch.from_numpy(as_numpy_images(images))[:, None]  # [N, 1, H, W] in [0, 1]
    x = F.adaptive_avg_pool2d(x, (8, 8))  # area average, like the data set's own binning
    return (x.reshape(len(x), 64) * 16.0).numpy()


def fit_classifier(features: np.ndarray, labels: np.ndarray):
    """An RBF SVC on `[N, 64]` 0-16 features (gamma from scikit-learn's digits example)."""
    from sklearn.svm import SVC

    return SVC(gamma=0.001, C=10.0).fit(features, labels)


@functools.lru_cache(maxsize=1)
def default_classifier():
    """Fitted once per process on all 1797 real digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    return fit_classifier(data.data, data.target)


def classify(images, model=None) -> np.ndarray:
    """The digit (0-9) each image shows, as an int array; `model` defaults to `default_classifier()`."""
    model = default_classifier() if model is None else model
    return model.predict(to_digit_features(images)).astype(int)


def digit_accuracy(images, labels, model=None) -> float:
    """Fraction of `images` that the classifier reads as the matching entry of `labels`."""
    labels = np.asarray(labels, dtype=int).reshape(-1)
    predicted = classify(images, model)
    if len(predicted) != len(labels):
        raise ValueError(f"{len(predicted)} images but {len(labels)} labels")
    return float((predicted == labels).mean())
