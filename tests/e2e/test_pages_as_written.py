"""The README's install and quickstart, then docs/api.md's example, typed as written by a newcomer.

The blocks a page tags (tests/markdown_blocks.py) run in a bash shell of the reader's (tests/e2e/reader_shell.py),
in page order, from the folder the page names: the install from the clone's folder, the quickstart from the
reader's own project folder, holding only the files the page says are theirs (their weights, a few photos, a
package, an ONNX file and its sidecar), the example from the clone's folder again. The reader's virtualenv is
active: ``rayline``, ``pip`` and ``python`` are this checkout's .venv's, which `make` installed from the clone
as the page's install line does.

Only the substitutions a page asks its reader to make are made:
  * ``my-bucket`` is a bucket of the test's on the session's S3-protocol server, whose endpoint and keys are in
    the environment as the reader's own credentials are (docs/storage.md);
  * ``http://prefect.example:4200/api`` and ``ray-head:6379``, "your own, if you have them", are the session's
    Prefect API and the Ray head of the package's `rayline up` (token auth: the token its `ray start` keeps in
    ~/.ray/auth_token), where the reader's serving port (RAYLINE_SERVE_PORT) is the platform's;
  * ``http://127.0.0.1:8000`` is the address `serve start` printed;
  * the suite runs offline: ``pip install`` gets ``--dry-run --no-index --no-build-isolation``, so pip builds
    the clone's metadata and resolves its extras against the packages installed, installing nothing.

On the reader's own cluster every command runs its work there, so this test is also the CLI's night, prepare
and fine-tune on an external cluster and a bucket whose endpoint the head does not know (the driver forwards
it). The head's own RAYLINE_STORAGE must stay untouched. Tuning on the same head is test_platform's demo.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rayline import lineage, storage
from rayline.ray_workloads.architectures.build import imagenet_classes
from rayline.ray_workloads.data import preprocess
from rayline.seed import sample_photos, seed
from rayline.storage.layout import (
    CHECKPOINTS_DIR,
    ERRORS_TABLE,
    MODELS_DIR,
    PREDICTIONS_TABLE,
    STAGING_DIR,
)
from rayline.tables.prediction_reads import read_night_pair
from tests.e2e.reader_shell import ReaderShell
from tests.integration.helpers import read_outputs
from tests.markdown_blocks import tagged_blocks
from tests.support import REPO_ROOT, create_bucket, delete_bucket

# the module's blocks run in its first test's setup: minutes of CLI commands, after the platform starts
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

README, API = REPO_ROOT / "README.md", REPO_ROOT / "docs" / "api.md"
VENV_BIN = Path(sys.executable).parent
CLASSES = ["cat", "dog", "bird"]  # the reader's pets.txt
MYNET = '''"""The reader's own network: a factory taking its width, and num_classes from rayline."""

from torch import nn


def build(width: int = 16, num_classes: int = 1000) -> nn.Module:
    features = [nn.Conv2d(3, width, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return nn.Sequential(*features, nn.Linear(width, num_classes))
'''


def _reader_files(project: Path, bucket: str) -> None:
    """What the quickstart says its reader has, saved as its table says: nothing downloaded, nothing trained."""
    import timm
    import torch
    import torchvision

    project.mkdir()
    torch.save(torchvision.models.get_model("resnet18", weights=None).state_dict(), project / "resnet18.pt")
    seed(str(project / "my-validation-photos"), photos=8, digits=False)
    (project / "some-photo.jpg").write_bytes(next(iter(sample_photos()))[1])
    (project / "pets.txt").write_text("".join(f"{name}\n" for name in CLASSES))
    timm_model = timm.create_model("resnet10t", pretrained=False, num_classes=len(CLASSES))
    torch.save(timm_model.state_dict(), project / "resnet10t.pt")
    package = project / "mynet"
    package.mkdir()
    (package / "__init__.py").write_text('__version__ = "1.0"\n')
    (package / "models.py").write_text(MYNET)
    namespace: dict[str, object] = {}
    exec(compile(MYNET, "mynet/models.py", "exec"), namespace)
    mynet = namespace["build"](width=64, num_classes=len(CLASSES))  # type: ignore[operator]
    torch.save(mynet.state_dict(), project / "mynet.pt")
    storage.write_bytes_atomic(f"s3://{bucket}/mynet.pt", (project / "mynet.pt").read_bytes())
    # the table's ONNX recipe: a batch of 2, the batch dimension dynamic, one file
    batch = torch.export.Dim("batch")
    torch.onnx.export(mynet.eval(), (torch.randn(2, 3, 224, 224),), str(project / "pets.onnx"),
                      dynamic_shapes=({0: batch},), external_data=False)  # fmt: skip
    (project / "pets.json").write_text(json.dumps({"classes": CLASSES}))


@dataclass(frozen=True)
class Read:
    """The pages' blocks as they ran: the reader's shell, the bucket's storage root, the cluster they joined."""

    shell: ReaderShell
    root: str
    cluster: str
    platform_files: frozenset[str]  # the head's own storage root's stage outputs before the blocks ran


@pytest.fixture(scope="module")
def read(
    platform: dict[str, str], s3_endpoint: str, prefect_api: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Read]:
    """Every tagged block of the pages, run once for the module's tests; its bucket deleted after."""
    bucket = f"my-bucket-{uuid.uuid4().hex[:12]}"
    create_bucket(s3_endpoint, bucket)
    home = tmp_path_factory.mktemp("newcomer")
    env = {k: v for k, v in os.environ.items() if k != "RAYLINE_STORAGE"}
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{env['PATH']}",  # the virtualenv active
        VIRTUAL_ENV=str(VENV_BIN.parent),
        RAYLINE_SERVE_PORT=platform["RAYLINE_SERVE_PORT"],
    )
    cluster = platform["RAY_ADDRESS"]
    assert "AWS_ENDPOINT_URL" not in platform, "the head must not know the endpoint: the reader's driver forwards it"
    shell = ReaderShell(
        env=env,
        cwd=REPO_ROOT,
        state=home / "shell-state",
        substitutions={
            "my-bucket": bucket,
            "http://prefect.example:4200/api": prefect_api,
            "ray-head:6379": cluster,
            "pip install ": "pip install --dry-run --no-index --no-build-isolation ",
        },
    )
    shell.state.mkdir()
    try:
        _reader_files(home / "my-project", bucket)
        before = _stage_outputs(platform)
        shell.run_blocks(tagged_blocks(README, "install"))
        shell.cwd = home / "my-project"
        shell.run_blocks(tagged_blocks(README, "quickstart"))
        shell.cwd = REPO_ROOT
        shell.run_blocks(tagged_blocks(API, "example"))
        yield Read(shell, f"s3://{bucket}/rayline", cluster, before)
    finally:
        # on the reader's own cluster the model serves on after Ctrl-C: the platform's later tests serve their own
        subprocess.run(
            [str(VENV_BIN / "rayline"), "serve", "stop", "--model", "photos"], cwd=home,
            env={**env, "RAYLINE_STORAGE": f"s3://{bucket}/rayline", "RAY_ADDRESS": cluster, "RAY_AUTH_MODE": "token"},
            capture_output=True, timeout=300,
        )  # fmt: skip
        delete_bucket(s3_endpoint, bucket)


def _printed(read: Read, page: Path, heading: str) -> str:
    """The first stdout of ``page``'s blocks that holds ``heading``."""
    outputs = [r.stdout for r in read.shell.ran if r.block.page == page and heading in r.stdout]
    assert outputs, f"nothing printed {heading!r}"
    return outputs[0]


def test_the_install_line_installs_rayline_with_its_extras_from_the_clone(read: Read) -> None:
    (ran,) = [r for r in read.shell.ran if r.block.tag == "install"]
    assert "Would install rayline-" in ran.stdout, ran.stdout[-2000:]
    assert "does not provide the extra" not in ran.stdout + ran.stderr, ran.stderr


def test_the_quickstart_serves_the_reader_s_model_and_answers_a_photo(read: Read) -> None:
    registered = _printed(read, README, "register-model finished")
    assert "photos v1" in registered, registered
    (answer,) = [r.stdout for r in read.shell.ran if r.block.second_shell]
    served = json.loads(answer)
    assert served["model"] == "photos" and served["version"] == 1, served
    assert served["class_name"] in imagenet_classes(), served


def test_the_quickstart_s_night_runs_on_the_reader_s_cluster_and_bucket(
    read: Read, platform: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each of the night's photos once, in the bucket; the night's run on the head of RAY_ADDRESS."""
    monkeypatch.setenv("RAYLINE_STORAGE", read.root)
    incoming = read.root.replace("/rayline", "/incoming/dt=2026-11-28")
    inputs = {storage.join(incoming, o.key) for o in storage.list_objects(incoming)}
    assert f"{len(inputs)} inputs → {len(inputs) - 1} predictions + 1 errors" in read.shell.output()
    pair = read_night_pair(read.root, "photos", "2026-11-28")
    uris = pair.predictions.column("uri").to_pylist() + pair.errors.column("uri").to_pylist()
    assert sorted(uris) == sorted(inputs) and pair.errors.num_rows == 1
    nights = [r for r in lineage.read_records("batch_inference") if r.run.ray_address == read.cluster]
    assert len(nights) == 2, "the quickstart's night and the example's, both on the reader's cluster"
    assert _stage_outputs(platform) == read.platform_files, "the reader's data landed in the head's storage root"


def test_the_quickstart_fine_tunes_on_the_reader_s_cluster(
    read: Read, platform: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """train-model prepares the labelled photos, one row each labelled by its folder, and trains a new head: each
    stage on the head of RAY_ADDRESS."""
    monkeypatch.setenv("RAYLINE_STORAGE", read.root)
    trained = _printed(read, README, "train-model finished")
    assert "fine-tuned from    photos v1 (head only), a new head for ['china', 'flower']" in trained, trained
    for stage in ("preprocess", "train"):
        (record,) = lineage.read_records(stage)
        assert record.run.ray_address == read.cluster, stage
    (prepared,) = lineage.read_records("preprocess")
    good, errors = read_outputs(preprocess.read_manifest(prepared.outputs[0].uri))
    labelled = read.root.replace("/rayline", "/labelled-photos")
    objects = {storage.join(labelled, o.key): o.key.split("/")[0] for o in storage.list_objects(labelled)}
    assert sorted(r["uri"] for r in good) == sorted(objects) and not errors, "one row per photo, none broken"
    assert all(r["label"] == objects[r["uri"]] for r in good), "a row's label is not its photo's folder"
    (train,) = lineage.read_records("train")
    assert train.outputs[0].uri.startswith(f"{read.root}/checkpoints/training/"), "checkpoints live in the bucket"
    assert _stage_outputs(platform) == read.platform_files, "the reader's data landed in the head's storage root"


def test_the_quickstart_registers_each_other_kind(read: Read) -> None:
    output = read.shell.output()
    for version in (1, 2, 3):
        assert f"pets v{version}" in output, output[-3000:]


def test_the_api_example_runs_rayline_s_night_inside_the_reader_s_own_flow(read: Read) -> None:
    """docs/examples/my_project's flow, run from its folder: its own `flows` and `tasks` packages beside
    rayline's, the night predicted as a subflow, then counted by its own task."""
    (ran,) = [r for r in read.shell.ran if r.block.page == API]
    report = ast.literal_eval(ran.stdout.strip().splitlines()[-1])
    seeded = [line for line in ran.stdout.splitlines() if line.startswith("seeded ")]
    total = int(seeded[0].split()[1])
    assert report["predictions"] + report["errors"] == total and report["errors"] == 1, report
    counted = sum(v for k, v in report.items() if k not in ("predictions", "errors"))
    assert counted == report["predictions"], report


def _stage_outputs(platform: dict[str, str]) -> frozenset[str]:
    """The files of the head's own RAYLINE_STORAGE, which its workers see, where a stage would put the reader's
    data (the platform's earlier tests, the demo among them, wrote theirs there; its schedules write none)."""
    root = Path(platform["RAYLINE_STORAGE"])
    ours = (MODELS_DIR, CHECKPOINTS_DIR, STAGING_DIR, PREDICTIONS_TABLE, ERRORS_TABLE)
    return frozenset(str(p.relative_to(root)) for top in ours for p in (root / top).rglob("*") if p.is_file())
