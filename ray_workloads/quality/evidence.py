"""Which labels may judge a challenger against the champion: the photos chosen whatever they answered, and
never a photo either version learned.

The paired test's promise (a no-better challenger passes at most alpha/(1-beta) of the time) holds only
for photos chosen independently of the versions' answers; a queue's targeted photos are those the champion
gets wrong more often. So the gate counts photos that are

* **random**: of every recorded random draw of the model's nights (``queue.RandomDraw``), or of imports
  declared random (``labels import --selection random``);
* **not trained on**: the imports a version (or any version it was fine-tuned from) learned
  (``ModelVersion.trained_on_labels``) judge neither it nor the other version.

A drawn photo left unlabelled is assumed left for reasons unrelated to its answer: label the random share whole.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from rayline.errors import InputDataError
from rayline.models import registry
from rayline.ray_workloads.quality.paired import Evidence, Photo
from rayline.ray_workloads.quality.queue import RandomDraw, recorded_draws
from rayline.tables import labels as labels_table

# A version's fine-tune chain is short; a longer one is read this far (each link is one small file).
_MAX_ANCESTORS = 32


def gate_evidence(root: str, model_name: str, versions: list[int]) -> Evidence:
    """The evidence rule for judging ``versions`` of ``model_name`` on the labels under ``root``."""
    learned = sorted({i for v in versions for i in learned_imports(model_name, v)})
    return evidence(
        recorded_draws(root, model_name),
        labels_table.read_labels(root, model_name),
        labels_table.photos_of_imports(root, model_name, learned),
    )


def evidence(draws: list[RandomDraw], labels: pa.Table, trained_on: frozenset[Photo]) -> Evidence:
    """The photos the gate counts: every draw's, and those of labels declared random; less ``trained_on``."""
    drawn: set[Photo] = {photo for draw in draws for photo in draw.photos}
    declared = labels.filter(pc.equal(labels["selection"], labels_table.RANDOM)) if labels.num_rows else labels
    drawn |= set(zip(declared["uri"].to_pylist(), declared["etag"].to_pylist(), strict=True))
    return Evidence(random=frozenset(drawn), trained_on=trained_on)


def learned_imports(model_name: str, version: int) -> set[str]:
    """The labels imports ``version`` and the versions it was fine-tuned from were trained on."""
    try:
        found = registry.get_version(model_name, version)
    except InputDataError:
        return set()  # not registered here: it learned nothing of these labels
    imports: set[str] = set()
    for _ in range(_MAX_ANCESTORS):
        if found.trained_on_labels is not None:
            imports |= set(found.trained_on_labels.import_ids)
        if found.parent is None:
            break
        found = registry.version_at(found.parent.uri)
    return imports
