"""Fine-tuning without Ray: the new head (torchvision, timm, the user's factory), a frozen backbone, and the plan."""

from __future__ import annotations

import re
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from rayline.cli import app
from rayline.errors import ConfigError, InferenceOnlyFormat, InputDataError
from rayline.models import registry
from rayline.ray_workloads.architectures.build import (
    ModelSpec,
    build_model,
    fine_tune_model,
    state_dict_bytes,
    trainable_parameters,
)
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.execution.interface import load
from rayline.ray_workloads.training.loop import TrainLoopConfig, make_optimizer, run_epoch
from rayline.ray_workloads.training.plan import FineTunePlan
from rayline.ray_workloads.training.plan import plan_training as plan_training_of
from rayline.ray_workloads.training.request import TrainRequest
from rayline.specs import FACTORY, FactoryRef, ImageSpec, ParentModel, squash

pytestmark = pytest.mark.unit

Planned = tuple[str, FineTunePlan | None]
HEADS = {"resnet18": "fc", "mobilenet_v3_small": "classifier.3", "small_cnn": "head.3"}


def _parent(arch: str, classes: int = 10) -> tuple[ModelSpec, dict[str, torch.Tensor]]:
    spec = ModelSpec(arch=arch, num_classes=classes, width=8)
    torch.manual_seed(1)
    return spec, build_model(spec).state_dict()


@pytest.mark.parametrize("arch", sorted(HEADS))
def test_the_parent_weights_load_and_the_head_is_new(arch: str) -> None:
    spec, state = _parent(arch)
    model = fine_tune_model(spec, state, "parent.pt", num_classes=3)
    head = HEADS[arch]
    tuned = model.state_dict()
    assert tuple(tuned[f"{head}.weight"].shape)[0] == 3
    assert set(tuned) == set(state), "the same architecture: only the head's shape changed"
    backbone = [k for k in state if not k.startswith(f"{head}.")]
    assert all(torch.equal(tuned[k], state[k]) for k in backbone)
    with torch.no_grad():
        assert model.eval()(torch.zeros(2, 3, 32, 32)).shape == (2, 3)
    # a fine-tuned model is a plain model of its architecture with the new class count
    build_model(spec.model_copy(update={"num_classes": 3})).load_state_dict(tuned)


def test_parent_weights_that_do_not_fit_are_named() -> None:
    spec, state = _parent("resnet18")
    with pytest.raises(InputDataError, match="weights at parent.pt do not fit resnet18 with 12 classes"):
        fine_tune_model(spec.model_copy(update={"num_classes": 12}), state, "parent.pt", num_classes=2)


@pytest.mark.parametrize("arch", ["resnet18", "mobilenet_v3_small"])
def test_a_frozen_backbone_trains_only_the_head_and_keeps_its_statistics(arch: str) -> None:
    spec, state = _parent(arch)
    model = fine_tune_model(spec, state, "parent.pt", num_classes=2, freeze_backbone=True)
    head = HEADS[arch]
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable == {f"{head}.weight", f"{head}.bias"}
    optimizer = make_optimizer(model, TrainLoopConfig(model=spec))
    assert sum(len(g["params"]) for g in optimizer.param_groups) == 2 == len(trainable_parameters(model))

    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(2)
    batches = [{"image": torch.randn(8, 3, 32, 32) * 3 + 1, "label_index": torch.randint(0, 2, (8,))}] * 3
    run_epoch(model, batches, torch.device("cpu"), optimizer)
    after = model.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved == {f"{head}.weight", f"{head}.bias"}, "backbone weights or batch-norm statistics moved"


def test_an_unfrozen_fine_tune_trains_everything() -> None:
    spec, state = _parent("resnet18")
    model = fine_tune_model(spec, state, "parent.pt", num_classes=2)
    assert len(trainable_parameters(model)) == len(list(model.parameters()))


def _register(name: str, spec: ModelSpec, image: ImageSpec, parent: ParentModel | None = None) -> registry.ModelVersion:
    version = registry.register(
        name,
        state_dict_bytes(build_model(spec)),
        model_spec=spec,
        image_spec=image,
        classes=[str(i) for i in range(spec.num_classes)],
        metrics={"test_accuracy": 0.5},
        code_version="test",
        parent=parent,
    )
    registry.set_alias(name, registry.CHAMPION, version.version, "test")
    return version


def test_the_flow_plans_a_fine_tune_from_init_from_or_from_the_champions_parent(local_storage: str) -> None:
    outside_spec = ModelSpec(arch="resnet18", num_classes=4)
    crop = ImageSpec(mode="resize_crop", resize=73, crop=64)
    outside = _register("photos", outside_spec, crop)
    _register("digits", ModelSpec(num_classes=10, width=4), squash(32))

    def plan_training(model_name: str | None, init_from: str | None, freeze_backbone: bool | None) -> Planned:
        asked = TrainRequest(model_name=model_name, init_from=init_from, freeze_backbone=freeze_backbone)
        plan = plan_training_of(asked)
        return plan.name, plan.fine_tune

    assert plan_training(None, None, None) == ("digits", None), "the digits train from scratch (and search)"
    with pytest.raises(ConfigError, match="freeze_backbone applies to fine-tuning only"):
        plan_training(None, None, True)

    name, plan = plan_training(None, "photos@champion", True)
    assert name == "photos-ft" and plan is not None
    assert plan.parent.version == outside.version and plan.parent.image_spec == crop
    assert plan.init().model == outside_spec and plan.init().freeze_backbone
    fresh = plan_training(None, "photos@champion", None)[1]
    assert fresh is not None and not fresh.freeze_backbone, "a fine-tune trains the whole net unless told otherwise"
    assert plan_training("flowers", "photos@v1", None)[0] == "flowers"

    link = plan.parent_link()
    assert link == ParentModel(name="photos", version=1, uri=outside.uri, freeze_backbone=True)
    _register("photos-ft", outside_spec.model_copy(update={"num_classes": 2}), crop, parent=link)
    _register("photos", outside_spec, crop)  # the outside model moved on: the retrain keeps the recorded parent
    name, again = plan_training("photos-ft", None, None)
    assert name == "photos-ft" and again is not None
    assert (again.parent.name, again.parent.version, again.freeze_backbone) == ("photos", 1, True)
    assert "champion photos-ft v1 was fine-tuned from photos v1" in again.why
    unfrozen = plan_training("photos-ft", None, False)[1]
    assert unfrozen is not None and not unfrozen.freeze_backbone

    with pytest.raises(InputDataError, match="model nothing has no 'champion' alias"):
        plan_training(None, "nothing@champion", None)
    with pytest.raises(ConfigError, match="nothing after '@'"):
        plan_training(None, "photos@", None)


def test_preprocessed_folders_differ_by_image_spec() -> None:
    def name(image: ImageSpec) -> str:
        cfg = preprocess.PreprocessConfig(ingest_manifest_uri="m", output_root="o", image=image)
        return preprocess._params_hash(cfg, ["a", "b"])

    resized = ImageSpec(mode="resize_crop", resize=73, crop=64)
    assert (
        len({name(squash(32)), name(squash(64)), name(resized), name(resized.model_copy(update={"resize": 80}))}) == 4
    )


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--arch", "resnet50"], "a fine-tune keeps the architecture"),
        (["--tune-samples", "4"], "fine-tuning runs no search"),
    ],
)
def test_the_command_line_refuses_what_a_fine_tune_cannot_honour(
    local_storage: str, extra: list[str], message: str
) -> None:
    result = CliRunner().invoke(app, ["train-model", "--init-from", "photos@champion", *extra])
    assert result.exit_code == 3 and message in result.output, result.output


def test_prepare_data_like_an_unknown_model_is_named(local_storage: str) -> None:
    result = CliRunner().invoke(app, ["prepare-data", "--like", "nothing@champion"])
    assert result.exit_code == 3 and "model nothing has no 'champion' alias" in result.output, result.output


TIMM_HEADS = {"test_efficientnet": "classifier", "test_resnet": "fc", "test_convnext": "head.fc"}


@pytest.mark.parametrize("name", sorted(TIMM_HEADS))
def test_a_timm_model_gets_a_new_head_through_its_own_reset_classifier(name: str) -> None:
    pytest.importorskip("timm")
    spec, state = _parent(f"timm:{name}", classes=7)
    model = fine_tune_model(spec, state, "parent.pt", num_classes=2, freeze_backbone=True)
    head = TIMM_HEADS[name]
    tuned = model.state_dict()
    assert tuple(tuned[f"{head}.weight"].shape)[0] == 2 and tuple(state[f"{head}.weight"].shape)[0] == 7
    assert all(torch.equal(tuned[k], state[k]) for k in state if not k.startswith(f"{head}."))
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {f"{head}.weight", f"{head}.bias"}
    with torch.no_grad():
        assert model.eval()(torch.zeros(1, 3, 64, 64)).shape == (1, 2)


FACTORIES = '''
from torch import nn


def mlp_head(width: int = 6, classes: int = 1000) -> nn.Module:
    """Takes no num_classes; its classifier is the last of two Linear layers."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes),
    )


def conv_head(num_classes: int, width: int = 6) -> nn.Module:
    """Takes num_classes; its classifier is a 1x1 convolution (SqueezeNet-style)."""
    layers = [nn.Conv2d(3, width, 3), nn.Conv2d(width, num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*layers)


def any_kwargs(**kwargs: int) -> nn.Module:
    """Takes num_classes among **kwargs."""
    return nn.Sequential(nn.Flatten(), nn.LazyLinear(kwargs["num_classes"]))


class WithReset(nn.Module):
    """timm's convention on the user's own class: reset_classifier/get_classifier, used over the last Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(4, 5)
        self.aux = nn.Linear(4, 9)  # last in module order, not the classifier
        self.resets = 0

    def forward(self, x):
        return self.fc(self.body(x))

    def get_classifier(self) -> nn.Module:
        return self.fc

    def reset_classifier(self, num_classes: int) -> None:
        self.resets += 1
        self.fc = nn.Linear(4, num_classes)


def with_reset() -> nn.Module:
    return WithReset()
'''


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of factories, importable for this test only; its name."""
    package = tmp_path / "ftfactories"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "ftfactories.nets"
    for name in [m for m in sys.modules if m.startswith("ftfactories")]:
        monkeypatch.delitem(sys.modules, name)


def _factory(target: str, classes: int, **kwargs: object) -> ModelSpec:
    return ModelSpec(arch=FACTORY, num_classes=classes, factory=FactoryRef(target=target, build_kwargs=kwargs))


def test_a_factory_without_num_classes_gets_its_last_linear_replaced(factories: str) -> None:
    spec = _factory(f"{factories}:mlp_head", 3, width=6)
    built = build_model(spec)  # the factory's 1,000 outputs, cut to the registered 3
    assert tuple(built.state_dict()["5.weight"].shape) == (3, 6) and tuple(built.state_dict()["3.weight"].shape) == (
        6,
        6,
    )
    state = built.state_dict()
    model = fine_tune_model(spec, state, "parent.pt", num_classes=2)
    tuned = model.state_dict()
    assert tuple(tuned["5.weight"].shape) == (2, 6), "the last Linear is the head"
    assert all(torch.equal(tuned[k], state[k]) for k in ("0.weight", "3.weight", "3.bias")), "the first Linear stays"
    assert model(torch.zeros(2, 3, 16, 16)).shape == (2, 2)


def test_a_factory_taking_num_classes_is_built_with_it(factories: str) -> None:
    conv = build_model(_factory(f"{factories}:conv_head", 4))
    assert tuple(conv.state_dict()["1.weight"].shape) == (4, 6, 1, 1), "built for 4 classes, not re-headed"
    model = fine_tune_model(_factory(f"{factories}:conv_head", 4), conv.state_dict(), "parent.pt", num_classes=2)
    assert tuple(model.state_dict()["1.weight"].shape) == (2, 6, 1, 1), "a 1x1 convolution head is replaced"
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 16, 16)).shape == (1, 2)
        assert build_model(_factory(f"{factories}:any_kwargs", 3))(torch.zeros(1, 3, 4, 4)).shape == (1, 3)


def test_a_factory_with_reset_classifier_is_re_headed_by_it(factories: str) -> None:
    spec = _factory(f"{factories}:with_reset", 5)
    parent = build_model(spec)
    model = fine_tune_model(spec, parent.state_dict(), "parent.pt", num_classes=2)
    assert model.resets == 1 and tuple(model.fc.weight.shape) == (2, 4)  # type: ignore[union-attr]
    assert tuple(model.aux.weight.shape) == (9, 4), "the last Linear in module order is left alone"  # type: ignore[union-attr]


def test_a_factory_that_cannot_be_imported_or_built_is_named(factories: str) -> None:
    with pytest.raises(InputDataError, match="module ftfactories.missing cannot be imported .*ship its folder"):
        build_model(_factory("ftfactories.missing:build", 2))
    with pytest.raises(InputDataError, match=f"module {factories} has no nothing"):
        build_model(_factory(f"{factories}:nothing", 2))
    with pytest.raises(InputDataError, match=re.escape("mlp_head(**{'depth': 3}) failed: TypeError")):
        build_model(_factory(f"{factories}:mlp_head", 2, depth=3))


@pytest.mark.parametrize(
    ("fmt", "named"),
    [
        ("torchscript", "a TorchScript file"),
        ("torch_export", "a torch.export program (.pt2)"),
        ("onnx", "an ONNX file"),
    ],
)
def test_a_code_free_parent_is_refused_before_any_cluster_time(local_storage: str, fmt: str, named: str) -> None:
    version = registry.register(
        "exported",
        b"not read: the plan refuses from the spec alone",
        model_spec=ModelSpec(arch=fmt, num_classes=3),
        image_spec=squash(32),
        classes=["a", "b", "c"],
        metrics={},
        code_version="test",
    )
    registry.set_alias("exported", registry.CHAMPION, version.version, "test")
    with pytest.raises(InferenceOnlyFormat, match=f"exported v1 is {re.escape(named)}, an inference-only format"):
        plan_training_of(TrainRequest(init_from="exported@champion"))
    with pytest.raises(InferenceOnlyFormat, match=f"{re.escape(named)} is an inference-only format"):
        fine_tune_model(version.model_spec, {}, "parent", num_classes=2)


def test_a_read_only_batch_is_predicted_without_a_warning(local_storage: str, tmp_path: Path) -> None:
    """Ray Data hands zero-copy (read-only) arrays; torch warns on them, and the test run makes warnings errors."""
    spec = ModelSpec(num_classes=3, width=4)
    weights = tmp_path / "w.pt"
    weights.write_bytes(state_dict_bytes(build_model(spec)))
    batch = np.zeros((2, 3, 32, 32), dtype=np.float32)
    batch.flags.writeable = False
    for optimize in (True, False):
        assert load(spec, str(weights), optimize=optimize).probabilities(batch).shape == (2, 3)
