"""Fine-tuning without Ray: the new head, a frozen backbone, and how the flow plans a fine-tune."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ray_workloads import preprocess
from ray_workloads.models import (
    ModelSpec,
    build_model,
    fine_tune_model,
    state_dict_bytes,
    trainable_parameters,
)
from ray_workloads.training_loop import TrainLoopConfig, make_optimizer, run_epoch
from rayline.cli import app
from rayline.errors import ConfigError, InputDataError
from rayline.models import registry
from rayline.specs import ImageSpec, ParentModel, squash
from tasks.training_plan import plan_training

pytestmark = pytest.mark.unit

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

    assert plan_training(None, None, None) == ("digits", None), "the digits train from scratch (and search)"
    with pytest.raises(ConfigError, match="freeze_backbone applies to fine-tuning only"):
        plan_training(None, None, True)

    name, plan = plan_training(None, "photos@champion", True)
    assert name == "photos-ft" and plan is not None
    assert plan.parent.version == outside.version and plan.parent.image_spec == crop
    assert plan.init().model == outside_spec and plan.init().freeze_backbone
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
    assert result.exit_code == 2 and message in result.output, result.output


def test_prepare_data_like_an_unknown_model_is_named(local_storage: str) -> None:
    result = CliRunner().invoke(app, ["prepare-data", "--like", "nothing@champion"])
    assert result.exit_code == 2 and "model nothing has no 'champion' alias" in result.output, result.output
