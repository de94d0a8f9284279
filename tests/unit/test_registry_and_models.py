from __future__ import annotations

import io
import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pytest
import torch

from rayline import storage
from rayline.errors import ConfigError, InputDataError, UnsafeCheckpointError
from rayline.models import registry, split_answers
from rayline.ray_workloads.architectures.build import (
    ModelSpec,
    build_model,
    load_model,
    state_dict_bytes,
)
from rayline.ray_workloads.nightly.request import NightRequest
from rayline.specs import DEFAULT_MODEL_NAME, ImageSpec
from rayline.storage import layout

pytestmark = pytest.mark.unit


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo this must never run",))


TEST_IMAGES = 400


def answers_right_on(right: np.ndarray) -> pa.Table:
    """Answers on one test split of ``right.size`` images: the truth where ``right``, another class elsewhere."""
    truth = np.arange(right.size) % 10
    predicted = np.where(right, truth, (truth + 1) % 10)
    keys = np.array([f"digits/{i % 10}/img-{i:04d}.png" for i in range(right.size)], dtype=object)
    etags = np.array([f"etag-{i}" for i in range(right.size)], dtype=object)
    return split_answers.answers_table(keys, etags, truth, predicted)


def answers_at(accuracy: float) -> pa.Table:
    """Answers right on the first ``accuracy`` share of the split's images: of two such versions, the more
    accurate one is right wherever the other is (wins only, no losses)."""
    return answers_right_on(np.arange(TEST_IMAGES) < round(accuracy * TEST_IMAGES))


def _register(weights: bytes, accuracy: float, answers: pa.Table | None = None) -> registry.ModelVersion:
    """A version judged on the one test split of these tests (same data hash), its answers kept with it."""
    return registry.register(
        "digits",
        weights,
        model_spec=ModelSpec().model_dump(),
        image_spec={"crop": 32},
        classes=[str(i) for i in range(10)],
        metrics={"test_accuracy": accuracy},
        data_manifest_uri="/data/manifest.json",
        data_content_hash="abc",
        code_version="git:deadbeef",
        answers=answers if answers is not None else answers_at(accuracy),
    )


def _paired(candidate: pa.Table, champion: pa.Table) -> split_answers.PairedCounts:
    return split_answers.paired_counts(candidate, champion)


@pytest.mark.parametrize("arch", ["small_cnn", "resnet18", "mobilenet_v3_small", "resnet152"])
def test_architectures_build_without_download(arch: str) -> None:
    model = build_model(ModelSpec(arch=arch, num_classes=7)).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 7)


def test_unknown_architecture_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown model architecture 'vgg99'"):
        build_model(ModelSpec(arch="vgg99"))


def test_weights_round_trip_through_a_file(tmp_path: object) -> None:
    spec = ModelSpec(arch="mobilenet_v3_small", num_classes=10)
    uri = os.path.join(str(tmp_path), "w.pt")
    original = build_model(spec)
    storage.write_bytes_atomic(uri, state_dict_bytes(original))
    loaded = load_model(spec, uri)
    for key, value in original.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key])


def test_pickled_objects_in_a_checkpoint_are_refused(tmp_path: object) -> None:
    uri = os.path.join(str(tmp_path), "evil.pt")
    buffer = io.BytesIO()
    torch.save({"weight": _Payload()}, buffer)
    storage.write_bytes_atomic(uri, buffer.getvalue())
    with pytest.raises(UnsafeCheckpointError, match="refusing checkpoint .*evil.pt"):
        load_model(ModelSpec(), uri)


def test_weights_of_another_architecture_are_named(tmp_path: object) -> None:
    uri = os.path.join(str(tmp_path), "w.pt")
    storage.write_bytes_atomic(uri, state_dict_bytes(build_model(ModelSpec(width=16))))
    with pytest.raises(InputDataError, match="do not fit small_cnn"):
        load_model(ModelSpec(width=32), uri)


def test_versions_are_unique_under_concurrent_registration(local_storage: str) -> None:
    weights = state_dict_bytes(build_model(ModelSpec(width=4)))
    with ThreadPoolExecutor(8) as pool:
        versions = list(pool.map(lambda i: _register(weights, 0.5).version, range(16)))
    assert sorted(versions) == list(range(1, 17))
    assert [v.version for v in registry.list_versions("digits")] == list(range(1, 17))


def test_gate_and_aliases(local_storage: str) -> None:
    weights = state_dict_bytes(build_model(ModelSpec(width=4)))
    first, worse, better = _register(weights, 0.95), _register(weights, 0.90), _register(weights, 0.97)
    assert not registry.gate(first, None, metric="m", candidate_score=0.8, paired=None, margin=0, floor=0.9).promoted
    assert registry.gate(first, None, metric="m", candidate_score=0.95, paired=None, margin=0, floor=0.9).promoted
    registry.set_alias("digits", registry.CHAMPION, first.version, "first")
    worse_paired = _paired(answers_at(0.90), answers_at(0.95))
    decision = registry.gate(worse, first, metric="m", candidate_score=0.90, paired=worse_paired, margin=0, floor=0.9)
    assert not decision.promoted and "does not beat champion v1" in decision.reason
    better_paired = _paired(answers_at(0.97), answers_at(0.95))  # 8 wins, no loss: p = 1/256
    assert not registry.gate(
        better, first, metric="m", candidate_score=0.97, paired=better_paired, margin=0.05, floor=0.9
    ).promoted
    assert registry.gate(
        better, first, metric="m", candidate_score=0.97, paired=better_paired, margin=0.01, floor=0.9
    ).promoted
    move = registry.set_alias("digits", registry.CHAMPION, better.version, "beat v1")
    assert move.previous == first.version
    assert registry.resolve("digits", "champion").version == better.version
    assert registry.resolve("digits", "v2").version == worse.version


def test_unfinished_versions_are_never_resolved(local_storage: str) -> None:
    storage.write_bytes_atomic(storage.join(registry.model_root("digits"), "v1", layout.CLAIM_FILE), b"x")
    assert registry.list_versions("digits") == []
    with pytest.raises(InputDataError, match="no registered version 1"):
        registry.set_alias("digits", registry.CHAMPION, 1, "nope")
    with pytest.raises(InputDataError, match="no 'champion' alias"):
        registry.resolve("digits", "champion")
    with pytest.raises(ConfigError, match="model name"):
        registry.model_root("Bad Name")


@pytest.mark.parametrize(
    ("model", "model_name", "expected"),
    [
        ("champion", None, ("digits", "champion")),
        ("v3", None, ("digits", "v3")),
        ("champion", "photos", ("photos", "champion")),
        ("photos@champion", None, ("photos", "champion")),
        ("photos@v2", "photos", ("photos", "v2")),
    ],
)
def test_the_nightly_model_option_takes_the_old_forms_and_name_at_ref(
    model: str, model_name: str | None, expected: tuple[str, str], local_storage: str
) -> None:
    assert _model_ref(model, model_name) == expected


def test_a_bare_registered_model_name_means_its_champion(local_storage: str) -> None:
    """``--model photos`` is photos@champion, not an alias 'photos' of digits; digits' own aliases still win."""

    assert _model_ref("photos", None) == ("digits", "photos")  # nothing named photos: an alias of digits
    registry.register("photos", b"w", model_spec=ModelSpec(), image_spec=ImageSpec(), classes=["a", "b"],
                      metrics={}, code_version="t")  # fmt: skip
    assert _model_ref("photos", None) == ("photos", "champion")
    assert registry.parse_named_ref("photos") == ("photos", "champion")
    assert registry.parse_named_ref("photos@v1") == ("photos", "v1")
    assert _model_ref("photos", "digits") == ("digits", "photos")  # a model named: its alias, whatever else exists


@pytest.mark.parametrize(
    ("model", "model_name", "message"),
    [
        ("photos@champion", "digits", "names model 'photos' but --model-name is 'digits'"),
        ("photos@", None, "nothing after '@'"),
        ("Photos@champion", None, "model name 'Photos'"),
        ("photos@what?", None, "neither an alias"),
    ],
)
def test_a_bad_nightly_model_option_is_named(
    model: str, model_name: str | None, message: str, local_storage: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        _model_ref(model, model_name)


def _model_ref(model: str, model_name: str | None) -> tuple[str, str]:
    """(name, ref) as a night request given ``--model`` and ``--model-name`` means them (``requested_version``)."""
    given = {"model": model} | ({"model_name": model_name} if model_name is not None else {})
    request = NightRequest.model_validate(given, context={"model_name": "--model-name"})
    if request.model_name is not None:
        return request.model_name, request.model
    return registry.parse_ref(request.model, DEFAULT_MODEL_NAME)


def _register_keyed(key: str | None) -> registry.ModelVersion:
    return registry.register(
        "digits",
        state_dict_bytes(build_model(ModelSpec(width=8))),
        model_spec=ModelSpec(width=8),
        image_spec=ImageSpec(crop=32),
        classes=[str(i) for i in range(10)],
        metrics={},
        code_version="test",
        idempotency_key=key,
    )


def test_a_retried_registration_gets_the_version_its_first_attempt_claimed(local_storage: str) -> None:
    first = _register_keyed("run-1")
    assert _register_keyed("run-1").version == first.version  # committed: the same version back
    other = _register_keyed("run-2")
    assert other.version == first.version + 1
    # a first attempt that claimed a number and died before committing: the retry finishes that one
    storage.remove_tree(storage.join(other.uri, layout.VERSION_FILE))
    assert _register_keyed("run-2").version == other.version
    assert [v.version for v in registry.list_versions("digits")] == [first.version, other.version]
    assert _register_keyed(None).version == other.version + 1  # no key: always a new version


def test_moving_an_alias_where_it_already_is_keeps_the_move_that_put_it_there(local_storage: str) -> None:
    one, two = _register_keyed(None), _register_keyed(None)
    registry.set_alias("digits", registry.CHAMPION, one.version, "first")
    moved = registry.set_alias("digits", registry.CHAMPION, two.version, "better")
    again = registry.set_alias("digits", registry.CHAMPION, two.version, "a retry")
    assert again == moved and again.previous == one.version and again.reason == "better"


def _register_classes(classes: list[str]) -> registry.ModelVersion:
    return registry.register(
        "pets", b"w", model_spec=ModelSpec(), image_spec=ImageSpec(), classes=classes, metrics={}, code_version="t"
    )


def test_a_new_version_may_add_classes_but_never_move_or_drop_one_and_a_refusal_names_both_lists(
    local_storage: str,
) -> None:
    """Labels and predictions are compared by class index: an index must mean one class in every version."""
    _register_classes(["cat", "dog"])
    _register_classes(["cat", "dog", "fox"])
    with pytest.raises(InputDataError) as moved:
        _register_classes(["dog", "cat", "fox"])
    message = str(moved.value)
    assert "['cat', 'dog']" in message and "['dog', 'cat', 'fox']" in message and "index 0" in message
    with pytest.raises(InputDataError, match=r"index 2 \('fox' in pets v2, none in the new version\)"):
        _register_classes(["cat", "dog"])
    assert [v.classes for v in registry.list_versions("pets")] == [["cat", "dog"], ["cat", "dog", "fox"]]
    assert not storage.exists(storage.join(registry.model_root("pets"), "v3", layout.CLAIM_FILE)), "no number claimed"
