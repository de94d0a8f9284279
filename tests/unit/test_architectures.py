"""Every torchvision classifier by name: its family, its head, its preprocessing and the input it takes.

Heavy architectures are built once each at most, on the meta device where
only the module tree matters, and run at small inputs.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torchvision
from torch import nn

from rayline import storage
from rayline.errors import ConfigError, WeightsMismatchError
from rayline.ray_workloads.architectures.build import (
    ModelSpec,
    build_model,
    check_input_size,
    fine_tune_model,
    imagenet_image_spec,
    load_model,
    state_dict_bytes,
)
from rayline.ray_workloads.architectures.torchvision_families import (
    FAMILIES,
    LIST_HINT,
    classifier_head,
    family_of,
    torchvision_names,
)
from rayline.ray_workloads.registration.outside_models import RegisterModelConfig, image_spec_for
from rayline.ray_workloads.registration.outside_models import run as register

pytestmark = pytest.mark.unit

# one architecture per family; regnet's initialisation cannot run on the meta device, so it is built for real
REPRESENTATIVES = {
    "alexnet": "alexnet",
    "convnext": "convnext_tiny",
    "densenet": "densenet121",
    "efficientnet": "efficientnet_b0",
    "googlenet": "googlenet",
    "inception": "inception_v3",
    "maxvit": "maxvit_t",
    "mnasnet": "mnasnet0_5",
    "mobilenetv2": "mobilenet_v2",
    "mobilenetv3": "mobilenet_v3_small",
    "regnet": "regnet_x_400mf",
    "resnet": "resnext50_32x4d",
    "shufflenetv2": "shufflenet_v2_x0_5",
    "squeezenet": "squeezenet1_1",
    "swin_transformer": "swin_v2_t",
    "vgg": "vgg11",
    "vision_transformer": "vit_b_32",
}


def test_every_torchvision_classifier_maps_to_a_family() -> None:
    names = torchvision_names()
    assert len(names) >= 80 and set(names) == set(torchvision.models.list_models(module=torchvision.models))
    families = {name: family_of(name).name for name in names}
    assert set(families.values()) == set(FAMILIES) == set(REPRESENTATIVES)
    assert families["wide_resnet50_2"] == families["resnext50_32x4d"] == "resnet"
    assert families["swin_v2_b"] == "swin_transformer" and families["vit_h_14"] == "vision_transformer"


@pytest.mark.parametrize("family", sorted(REPRESENTATIVES))
def test_each_family_head_is_where_the_table_says(family: str) -> None:
    arch = REPRESENTATIVES[family]
    device = "cpu" if family == "regnet" else "meta"
    with torch.device(device):
        model = build_model(ModelSpec(arch=arch, num_classes=7))
    _, _, head = classifier_head(model, arch)
    outputs = head.out_features if isinstance(head, nn.Linear) else head.out_channels
    assert outputs == 7, f"{arch}'s head {family_of(arch).head} is not its classifier"
    last = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Conv2d)][-1]
    assert last is head, f"{arch}: a later layer than {family_of(arch).head} computes the classes"


@pytest.mark.parametrize(("arch", "side"), [("efficientnet_b0", 32), ("convnext_tiny", 32), ("squeezenet1_1", 48)])
def test_fine_tuning_replaces_only_the_head(arch: str, side: int) -> None:
    spec = ModelSpec(arch=arch, num_classes=5)
    torch.manual_seed(0)
    state = build_model(spec).state_dict()
    model = fine_tune_model(spec, state, "parent.pt", num_classes=3, freeze_backbone=True)
    head = family_of(arch).head
    tuned = model.state_dict()
    assert tuned[f"{head}.weight"].shape[0] == 3
    assert set(tuned) == set(state)
    assert all(torch.equal(tuned[k], v) for k, v in state.items() if not k.startswith(f"{head}."))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {f"{head}.weight", f"{head}.bias"}
    with torch.no_grad():
        assert model.eval()(torch.zeros(2, 3, side, side)).shape == (2, 3)


def test_auxiliary_heads_of_a_torchvision_state_dict_are_left_out(tmp_path: Path) -> None:
    """A GoogLeNet saved with its auxiliary classifiers loads, and trains on a plain tensor output."""
    torch.manual_seed(0)
    theirs = torchvision.models.googlenet(weights=None, num_classes=4, aux_logits=True, init_weights=True)
    uri = os.path.join(str(tmp_path), "googlenet.pt")
    storage.write_bytes_atomic(uri, state_dict_bytes(theirs))
    model = load_model(ModelSpec(arch="googlenet", num_classes=4), uri)
    assert isinstance(model.train()(torch.zeros(2, 3, 32, 32)), torch.Tensor)


def test_a_conv_headed_model_registers_and_a_wrong_class_count_is_named(local_storage: str, tmp_path: Path) -> None:
    """SqueezeNet's head is a 1×1 convolution: its class count is still read from the file and checked."""
    uri, classes = str(tmp_path / "squeezenet.pt"), tmp_path / "classes.txt"
    storage.write_bytes_atomic(uri, state_dict_bytes(build_model(ModelSpec(arch="squeezenet1_1", num_classes=4))))
    classes.write_text("a\nb\nc\n")
    cfg = RegisterModelConfig(name="squeeze", arch="squeezenet1_1", weights_uri=uri, classes=str(classes))
    with pytest.raises(
        WeightsMismatchError, match="do not fit squeezenet1_1 with 3 classes; the file's classifier head has 4"
    ):
        register(cfg)
    classes.write_text("a\nb\nc\nd\n")
    version = register(cfg).version
    assert (version.model_spec.arch, version.image_spec.crop, version.image_spec.resize) == ("squeezenet1_1", 224, 256)


def test_imagenet_preprocessing_comes_from_each_weights_entry() -> None:
    def sizes(arch: str) -> tuple[int | None, int, str]:
        spec = imagenet_image_spec(arch)
        return spec.resize, spec.crop, spec.interpolation

    assert sizes("efficientnet_b0") == (256, 224, "bicubic")
    assert sizes("efficientnet_b3") == (320, 300, "bicubic")
    assert sizes("swin_v2_t") == (260, 256, "bicubic")
    assert sizes("convnext_tiny") == (236, 224, "bilinear")
    # its default entry wants 518 px; rayline's build takes 224, so the 224 entry's transform is used
    assert sizes("vit_h_14") == (224, 224, "bicubic")


def test_every_classifiers_own_preprocessing_fits_it() -> None:
    for arch in torchvision_names():
        spec = imagenet_image_spec(arch)
        check_input_size(arch, spec.crop, spec.resize)


def test_a_vit_takes_only_the_size_it_was_built_for() -> None:
    model = build_model(ModelSpec(arch="vit_b_32", num_classes=3)).eval()
    fixed = family_of("vit_b_32").fixed_size
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 224, 224)).shape == (1, 3)
        with pytest.raises(AssertionError):
            model(torch.zeros(1, 3, 256, 256))
    assert fixed == 224 and family_of("maxvit_t").fixed_size == 224 and family_of("swin_t").fixed_size is None


def test_a_size_that_does_not_fit_is_refused_before_the_weights_are_read() -> None:
    def cfg(**sizes: int) -> RegisterModelConfig:
        return RegisterModelConfig(name="m", arch="vit_b_16", weights_uri="/nowhere/vit.pt", **sizes)

    with pytest.raises(ConfigError, match=r"vit_b_16 takes only 224×224 input.* gives 256×256: it needs crop 224"):
        register(cfg(crop=256))
    with pytest.raises(ConfigError, match=r"--resize 200 .* at least 224"):
        image_spec_for(cfg(resize=200))
    with pytest.raises(ConfigError, match=r"inception_v3 needs input of at least 75×75, .* gives 64×64"):
        check_input_size("inception_v3", 64)
    assert image_spec_for(cfg(resize=300)).crop == 224


def test_training_from_scratch_refuses_what_the_digits_squares_do_not_fit() -> None:
    from rayline.ray_workloads.training.request import TrainRequest

    with pytest.raises(ConfigError, match=r"maxvit_t takes only 224×224 input.* gives 32×32"):
        TrainRequest(arch="maxvit_t")


def test_an_unknown_name_says_how_to_list_the_known_ones() -> None:
    with pytest.raises(ConfigError) as raised:
        build_model(ModelSpec(arch="efficientnet_b9"))
    message = str(raised.value)
    assert "unknown model architecture 'efficientnet_b9' (did you mean efficientnet_b" in message
    assert LIST_HINT in message and "vgg19_bn" not in message and len(message) < 400
