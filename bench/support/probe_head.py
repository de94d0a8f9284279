"""A random backbone with a trained linear head: logits with real margins, for a bench that gates precision.

A ``weights=None`` ResNet's 1,000 logits are nearly tied on photos, so the accuracy gate rightly refuses
any lower precision on them (bench/README.md). Nothing pretrained can be downloaded, so the bench's model
is what a user's fine-tuned classifier resembles: the random backbone (which sets the speed) and a head
fitted on its features of views of scikit-learn's two sample photos, the photos the nights score.
"""

from __future__ import annotations

from typing import Any

VIEWS = 48  # fitting views: the features of 48 photos take a few seconds on one core


def fit_photo_head(model: Any, image_spec: Any) -> list[str]:
    """Replace ``model.fc`` with a 2-class head fitted on its own features of sample-photo views; the classes."""
    import numpy as np
    import torch
    from sklearn.linear_model import LogisticRegression

    from rayline.ray_workloads.data.images import decode_image
    from rayline.seed import PHOTO_LABELS, photo_objects

    views = list(photo_objects(VIEWS, np.random.default_rng(5)))
    images = torch.from_numpy(np.stack([decode_image(data, image_spec) for _, data in views]))
    labels = np.array([PHOTO_LABELS.index(key.split("/")[0]) for key, _ in views])
    head, model.fc = model.fc, torch.nn.Identity()
    with torch.inference_mode():
        features = model.eval()(images).numpy()
    fitted = LogisticRegression(C=1.0, max_iter=2000).fit(features, labels)
    model.fc = torch.nn.Linear(head.in_features, len(PHOTO_LABELS))
    with torch.no_grad():
        # two classes: logistic regression's one weight vector w is the logit gap; ±w/2 gives it to softmax
        weight = torch.from_numpy(fitted.coef_[0].astype(np.float32)) / 2
        model.fc.weight.copy_(torch.stack([-weight, weight]))
        bias = float(fitted.intercept_[0]) / 2
        model.fc.bias.copy_(torch.tensor([-bias, bias]))
    return list(PHOTO_LABELS)
