"""A trained classifier in seconds, for what random weights cannot show: how reduced precision changes answers.

A ResNet-18 trained from scratch on scikit-learn's digits (8×8, upsampled), shared by tests and benches. Its
logits have real margins; a ``weights=None`` network's are nearly tied, so any perturbation flips them and an
accuracy gate measured on them says nothing. Deterministic for a seed on one machine; CPUs differ in the last
bits, which the margins of 60+ steps absorb.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from torch import nn

TRAIN_IMAGES = 1500  # the rest of the 1,797 digits are held out


def digits_resnet18(
    side: int = 32, steps: int = 60, seed: int = 0, device: str = "cpu"
) -> tuple[nn.Module, np.ndarray, np.ndarray]:
    """ResNet-18 trained ``steps`` Adam steps of 64 digits at ``side`` px on ``device``, in eval mode and
    channels-last; with the held-out images (N, 3, side, side) float32 and their labels, in numpy."""
    import torch
    from sklearn.datasets import load_digits
    from torchvision.models import resnet18

    torch.manual_seed(seed)
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0
    images = torch.nn.functional.interpolate(images, size=(side, side), mode="bilinear").repeat(1, 3, 1, 1)
    labels = torch.tensor(digits.target)
    model = resnet18(weights=None, num_classes=10).to(device)
    train_images, train_labels = images[:TRAIN_IMAGES].to(device), labels[:TRAIN_IMAGES].to(device)
    optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    batches = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        index = torch.randint(0, TRAIN_IMAGES, (64,), generator=batches).to(device)
        loss = torch.nn.functional.cross_entropy(model(train_images[index]), train_labels[index])
        optimizer.zero_grad()
        torch.autograd.backward(loss)
        optimizer.step()
    model.eval()
    return model.to(memory_format=torch.channels_last), images[TRAIN_IMAGES:].numpy(), labels[TRAIN_IMAGES:].numpy()
