"""`rayline register-model`: a user's torchvision weights file becomes a registered version.

The user's weights are a torchvision model built with ``weights=None`` and
saved as a state dict (nothing can be downloaded here), on local disk and on
the S3-protocol server.
"""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from typer.testing import CliRunner

from rayline import events, storage
from rayline.cli import app
from rayline.models import registry
from tests.integration.helpers import one_stored_event

pytestmark = pytest.mark.integration


def _state_dict_bytes(arch: str, num_classes: int = 1000) -> bytes:
    model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getvalue()


def _register(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["register-model", *args])
    return result.exit_code, result.output + (str(result.exception) if result.exception else "")


def test_register_a_resnet_from_a_file_then_again(
    tmp_path: Path, local_storage: str, prefect_api: str, test_started: float
) -> None:
    weights = tmp_path / "resnet18.pt"
    weights.write_bytes(_state_dict_bytes("resnet18"))
    code, out = _register("--name", "photos", "--arch", "resnet18", "--weights", str(weights), "--alias", "champion")
    assert code == 0, out
    assert "registered as" in out and "photos v1" in out

    version = registry.resolve("photos", "champion")
    assert version.version == 1 and version.model_spec.arch == "resnet18"
    assert (version.image_spec.mode, version.image_spec.resize, version.image_spec.crop) == ("resize_crop", 256, 224)
    assert len(version.classes) == 1000 and version.classes[0] == "tench"
    assert version.data_manifest_uri is None and version.weights_source is not None
    assert version.weights_source.sha256 == hashlib.sha256(weights.read_bytes()).hexdigest()
    assert version.weights_source.uri == str(weights)  # tmp_path: already absolute
    assert version.image_spec.draft  # reduced-scale JPEG decoding unless --full-decode
    stored = torch.load(io.BytesIO(storage.read_bytes(version.weights_uri)), weights_only=True)
    assert set(stored) == set(torchvision.models.resnet18().state_dict())
    moved = one_stored_event(prefect_api, events.ALIAS_MOVED, events.model_resource("photos", 1), since=test_started)
    assert moved["payload"] == {
        "model": "photos", "alias": "champion", "version": 1, "previous": None, "reason": f"registered from {weights}"
    }  # fmt: skip

    # the same file again (a retried or repeated command) is the same version, not a second one
    code, out = _register("--name", "photos", "--arch", "resnet18", "--weights", str(weights))
    assert code == 0 and "already registered as" in out and "photos v1" in out, out
    assert [v.version for v in registry.list_versions("photos")] == [1]
    assert version.samples_uri is None  # its plans are judged on stand-in photos


def test_register_with_the_models_own_sample_images(tmp_path: Path, local_storage: str, prefect_api: str) -> None:
    """The first 32 images by key, decoded as the version decodes its inputs, kept with it; a file that is not
    an image is refused by name before anything is registered; the same weights given samples later are a new
    version that has them."""
    from rayline.seed import photo_variant, source_photos

    weights = tmp_path / "resnet18.pt"
    weights.write_bytes(_state_dict_bytes("resnet18", num_classes=2))
    (tmp_path / "classes.txt").write_text("china\nflower\n")
    common = ["--name", "photos", "--arch", "resnet18", "--weights", str(weights), "--classes",
              str(tmp_path / "classes.txt"), "--crop", "64", "--resize", "72"]  # fmt: skip
    assert _register(*common)[0] == 0
    samples = tmp_path / "samples"
    samples.mkdir()
    rng = np.random.default_rng(0)
    for i in range(34):
        photo = photo_variant(source_photos()[i % 2], rng)[0]
        (samples / f"{i:02d}.jpg").write_bytes(photo)
    (samples / "zz-notes.txt").write_text("not a photo")
    code, out = _register(*common, "--samples", str(samples))
    assert code == 0, out
    (version,) = [v for v in registry.list_versions("photos") if v.samples_uri]
    assert version.version == 2
    stored = registry.read_samples(version)
    assert stored is not None and stored.shape == (32, 3, 64, 64) and stored.dtype == np.float32
    assert len({image.tobytes() for image in stored}) == 32
    (samples / "00.jpg").write_text("not a photo either")
    code, out = _register(*common, "--samples", str(samples))
    assert code != 0 and f"--samples: {samples / '00.jpg'} is not an image the model can take" in out, out
    assert [v.version for v in registry.list_versions("photos")] == [1, 2]


def test_register_from_s3_with_a_classes_file(s3_storage: str, prefect_api: str) -> None:
    weights_uri = storage.join(s3_storage, "user", "pets.pt")
    classes_uri = storage.join(s3_storage, "user", "classes.txt")
    storage.write_bytes_atomic(classes_uri, b"cat\ndog\n\nbird\n")
    storage.write_bytes_atomic(weights_uri, _state_dict_bytes("resnet18"))  # a 1,000-class head

    code, out = _register("--name", "pets", "--arch", "resnet18", "--weights", weights_uri, "--classes", classes_uri)
    assert code != 0
    assert "the file's classifier head has 1000 classes" in out and "fc.weight" in out, out

    storage.write_bytes_atomic(weights_uri, _state_dict_bytes("resnet18", num_classes=3))
    code, out = _register(
        "--name", "pets", "--arch", "resnet18", "--weights", weights_uri, "--classes", classes_uri,
        "--crop", "128", "--alias", "challenger",
    )  # fmt: skip
    assert code == 0, out
    assert "pets had no champion: v1 is champion, not challenger" in out, out  # nothing to canary it against
    assert registry.alias_version("pets", "challenger") is None
    version = registry.resolve("pets", "champion")
    assert version.classes == ["cat", "dog", "bird"]
    assert (version.image_spec.resize, version.image_spec.crop) == (146, 128)  # 256/224 kept
    assert version.weights_source is not None and version.weights_source.uri == weights_uri


def test_bad_weights_are_refused_with_what_to_do(tmp_path: Path, local_storage: str, prefect_api: str) -> None:
    whole = tmp_path / "whole-model.pt"
    torch.save(torchvision.models.resnet18(weights=None), whole)
    code, out = _register("--name", "photos", "--arch", "resnet18", "--weights", str(whole))
    assert code != 0
    assert "pickled objects" in out and "torch.save(model.state_dict()" in out, out

    wrong_arch = tmp_path / "resnet18.pt"
    wrong_arch.write_bytes(_state_dict_bytes("resnet18"))
    code, out = _register("--name", "photos", "--arch", "resnet50", "--weights", str(wrong_arch))
    assert code != 0
    assert "do not fit resnet50" in out and "missing keys" in out and "wrong shapes" in out, out

    code, out = _register("--name", "photos", "--arch", "resnet18", "--weights", str(tmp_path / "absent.pt"))
    assert code != 0 and "absent.pt" in out, out
    assert registry.list_versions("photos") == []
