"""The promotion gate: register trained weights as a new version, judge it against the champion, move an alias.

The candidate is judged on its own test split, image by image against the champion
(:func:`rayline.models.registry.gate`: an exact McNemar test at ``alpha`` and the accuracy ``margin``;
the champion's answers: :func:`_paired`). A candidate that passes becomes ``promote_to``: ``champion``, or
``challenger`` when a canary rollout moves the champion later; the first model past the floor is champion.

Every step is safe to repeat: a retry with the same ``idempotency_key`` gets the version its first attempt
registered, and judges it against the version it replaced if that attempt promoted it already.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, Field

from rayline import storage
from rayline.errors import AliasConflict, ConfigError
from rayline.lineage import DatasetRef
from rayline.models import registry, split_answers
from rayline.ray_workloads.architectures.build import ModelSpec, state_dict_from_bytes
from rayline.ray_workloads.data import preprocess
from rayline.ray_workloads.execution.plan import PROBE_IMAGES
from rayline.ray_workloads.quality.paired import PairedTest
from rayline.ray_workloads.quality.reading import labelled_gate
from rayline.ray_workloads.training import evaluate
from rayline.ray_workloads.training.request import GateOptions
from rayline.ray_workloads.training.train import TrainResult
from rayline.specs import ParentModel

GATE_METRIC = "test_accuracy"
# how often a candidate is judged again when the champion moved between its gate and its promotion
REGATES = 3

log = logging.getLogger(__name__)


class PromotionConfig(GateOptions):
    """A trained model to register under ``name`` and gate."""

    name: str
    spec: ModelSpec
    trained: TrainResult
    evaluation: evaluate.EvaluationResult
    parent: ParentModel | None = Field(None, description="The version a fine-tune started from.")
    trained_on_labels: registry.TrainingLabels | None = Field(None, description="The labels imports it learned.")
    code_version: str = "unknown"
    flow_run_id: str | None = None
    idempotency_key: str | None = Field(None, description="The same in every attempt: a retry registers nothing new.")
    champion_wait_s: float = Field(600.0, description="How long a champion move waits for a running rollout.")
    labelled_root: str | None = Field(
        None, description="Where the labels are: the champion then moves only on a labelled win (_labelled_alias)."
    )


class PromotionResult(BaseModel):
    """The version registered, the gate's decision, and the alias it got (if it passed)."""

    version: registry.ModelVersion
    decision: registry.GateDecision
    alias: str | None = None
    moves: list[registry.AliasMove] = Field(default_factory=list)
    champion: int | None = Field(description="The model's champion version after the gate.")
    checkpoint_uri: str = Field(description="The Train checkpoint the weights came from.")
    data_manifest_uri: str = Field(description="The preprocessed data holding the test split it was judged on.")
    data_content_hash: str = Field(description="The version of the input that data was prepared from.")
    parent: ParentModel | None = None
    labelled: PairedTest | None = Field(None, description="The labelled paired test, when the gate required one.")

    def lineage_inputs(self) -> list[DatasetRef]:
        parent = self.parent
        started = (
            [DatasetRef(uri=parent.uri, facets={"parent": parent.model_dump()}, stored_as="model")] if parent else []
        )
        checkpoint = DatasetRef(uri=self.checkpoint_uri, stored_as="folder")
        return [checkpoint, DatasetRef(uri=self.data_manifest_uri, stored_as="manifest"), *started]

    def lineage_outputs(self) -> list[DatasetRef]:
        facets = {"moves": [m.model_dump(mode="json") for m in self.moves], "gate": self.decision.model_dump()}
        return [DatasetRef(uri=self.version.uri, content_hash=self.data_content_hash, facets=facets, stored_as="model")]


def test_samples(prepared: preprocess.PreprocessResult, count: int = PROBE_IMAGES) -> np.ndarray | None:
    """Up to ``count`` images of the test split, decoded, taken in turn from each class: the version's samples."""
    files = prepared.read_files().get("test", []) if prepared.file_counts.get("test") else []
    if not files:
        return None
    rows = storage.read_parquet(files[:1], columns=["image", "label_index"])
    labels = np.asarray(rows.column("label_index").to_numpy())
    by_class = [np.flatnonzero(labels == label).tolist() for label in np.unique(labels)]
    chosen: list[int] = []
    for turn in range(max(len(picks) for picks in by_class)):
        chosen.extend(picks[turn] for picks in by_class if turn < len(picks))
    images: np.ndarray = rows.column("image").combine_chunks().take(chosen[:count]).to_numpy()
    return images.astype(np.float32, copy=False)


def run(cfg: PromotionConfig) -> PromotionResult:
    """Register the trained weights, gate them against the champion, and move the alias they earned."""
    trained, evaluation = cfg.trained, cfg.evaluation
    prepared = preprocess.read_manifest(evaluation.data_manifest_uri)
    weights = storage.read_bytes(trained.weights_uri)
    state_dict_from_bytes(weights, trained.weights_uri)  # refuse anything but tensors before registering
    _check_same_classes(cfg.name, prepared.classes)
    answers = _candidate_answers(cfg)
    version = registry.register(
        cfg.name,
        weights,
        model_spec=cfg.spec.model_copy(update={"num_classes": len(prepared.classes)}),
        image_spec=prepared.image,
        classes=prepared.classes,
        metrics={GATE_METRIC: evaluation.accuracy, **{f"best_{k}": v for k, v in trained.metrics.items()}},
        data_manifest_uri=evaluation.data_manifest_uri,
        data_content_hash=prepared.input_content_hash,
        code_version=cfg.code_version,
        training_run_uri=trained.run_uri,
        flow_run_id=cfg.flow_run_id,
        parent=cfg.parent,
        trained_on_labels=cfg.trained_on_labels,
        idempotency_key=cfg.idempotency_key,
        samples=test_samples(prepared),
        answers=answers,
    )
    decision, moves, labelled = gate_and_move(
        cfg.name, version, answers, cfg, champion_wait_s=cfg.champion_wait_s, labelled_root=cfg.labelled_root
    )
    return PromotionResult(
        version=version,
        decision=decision,
        alias=moves[0].alias if moves else None,
        moves=moves,
        champion=registry.alias_version(cfg.name, registry.CHAMPION),
        checkpoint_uri=trained.checkpoint_uri,
        data_manifest_uri=evaluation.data_manifest_uri,
        data_content_hash=prepared.input_content_hash,
        parent=cfg.parent,
        labelled=labelled,
    )


def _candidate_answers(cfg: PromotionConfig) -> pa.Table:
    """The candidate's answers on its test split, image by image: those its evaluation wrote, else evaluated now."""
    evaluation = cfg.evaluation
    if evaluation.answers_uri is not None:
        return storage.read_parquet([evaluation.answers_uri], columns=split_answers.SCHEMA.names)
    return evaluate.split_answers_of(cfg.spec, cfg.trained.weights_uri, evaluation.data_manifest_uri, evaluation.split)


def _labelled_alias(
    decision: registry.GateDecision, alias: str, labelled_root: str | None, name: str
) -> tuple[registry.GateDecision, str | None, PairedTest | None]:
    """The alias a candidate that passed the test split earns once the labels are asked too: the champion
    only on a passed paired test, challenger while it is inconclusive, none when it failed."""
    if labelled_root is None or alias != registry.CHAMPION or decision.champion is None:
        return decision, alias, None
    test = labelled_gate(labelled_root, name, decision.champion, decision.candidate)
    if test.outcome == "passed":
        return decision.model_copy(update={"reason": f"{decision.reason}; labels: {test.describe()}"}), alias, test
    if test.outcome == "failed":
        reason = f"{decision.reason}, but the labels say otherwise: {test.describe()}"
        return decision.model_copy(update={"promoted": False, "reason": reason}), None, test
    reason = f"{decision.reason}; challenger until the labels decide ({test.describe()})"
    return decision.model_copy(update={"reason": reason}), registry.CHALLENGER, test


def gate_and_move(
    name: str,
    version: registry.ModelVersion,
    answers: pa.Table,
    gate: GateOptions,
    *,
    champion_wait_s: float = 0.0,
    labelled_root: str | None = None,
) -> tuple[registry.GateDecision, list[registry.AliasMove], PairedTest | None]:
    """Gate ``version`` (``answers``: its own on its test split) against the champion and move the alias it
    earned (``gate.promote_to``), conditional on that same champion.

    A champion moved meanwhile (a rollout promoted another version) means judging again, against the new one.
    A running rollout holding the champion is waited for up to ``champion_wait_s``, then its ``AliasConflict``
    is raised. ``labelled_root``: the champion moves only on a labelled win too (:func:`_labelled_alias`).
    """
    for attempt in range(REGATES):
        decision, alias, labelled = _judge(name, version, answers, gate, labelled_root)
        if alias is None:
            return decision, [], labelled
        # a challenger is judged against the champion too, but moves no champion: any challenger may be replaced
        expected = decision.champion if alias == registry.CHAMPION else registry.Unchecked.ANY
        try:
            move = registry.set_alias(
                name, alias, version.version, decision.reason, expected=expected, lease_wait_s=champion_wait_s
            )
        except AliasConflict as exc:
            if exc.rollout_holder is not None or attempt + 1 == REGATES:
                raise  # a rollout still holds the champion, or the alias keeps moving under every gate
            log.info(
                "%s's %s moved to v%s while v%d was gated: judging again", name, alias, exc.current, version.version
            )
            continue
        return decision, [move], labelled
    raise AssertionError("unreachable: the last attempt returns or raises")


def _judge(
    name: str, version: registry.ModelVersion, answers: pa.Table, gate: GateOptions, labelled_root: str | None
) -> tuple[registry.GateDecision, str | None, PairedTest | None]:
    """The gate's decision against the champion now, the alias it earned (None: none) and the labels' test."""
    champion = _champion_against(name, version)
    decision = registry.gate(
        version,
        champion,
        metric=GATE_METRIC,
        candidate_score=split_answers.accuracy(answers),
        paired=_paired(champion, version, answers) if champion is not None else None,
        margin=gate.margin,
        floor=gate.floor,
        alpha=gate.alpha,
    )
    if not decision.promoted:
        return decision, None, None
    alias = registry.CHAMPION if champion is None or gate.promote_to == registry.CHAMPION else registry.CHALLENGER
    return _labelled_alias(decision, alias, labelled_root, name)


def _champion_against(name: str, candidate: registry.ModelVersion) -> registry.ModelVersion | None:
    """The champion the candidate is judged against (None: there is none yet)."""
    number = registry.alias_version(name, registry.CHAMPION)
    if number is not None and number == candidate.version:
        # a retried attempt: the first one already promoted it; judge it against the version it replaced
        move = registry.alias_move(name, registry.CHAMPION)
        number = move.previous if move is not None else None
    return registry.get_version(name, number) if number is not None else None


def _paired(
    champion: registry.ModelVersion, candidate: registry.ModelVersion, answers: pa.Table
) -> split_answers.PairedCounts:
    """Both versions' answers on the candidate's test split, image by image. The champion's are those kept
    with it for these images (its own test split, or an earlier gate's); else it answers them now, on Ray,
    and they are kept for the next candidate on the same images."""
    theirs = split_answers.read(champion.uri, split_answers.split_digest(answers))
    if theirs is None:
        if candidate.data_manifest_uri is None:
            raise ConfigError(f"{candidate.name} v{candidate.version} has no test split to judge it on")
        theirs = evaluate.split_answers_of(champion.model_spec, champion.weights_uri, candidate.data_manifest_uri)
        split_answers.store(champion.uri, theirs)
    return split_answers.paired_counts(answers, theirs)


def _check_same_classes(name: str, classes: list[str]) -> None:
    """A candidate is judged against its champion on one test split: both must predict the same classes."""
    number = registry.alias_version(name, registry.CHAMPION)
    if number is None:
        return
    champion = registry.get_version(name, number)
    if champion.classes != classes:
        shown = ", ".join(champion.classes[:5]) + (", …" if len(champion.classes) > 5 else "")
        raise ConfigError(
            f"{name}'s champion v{number} predicts {len(champion.classes)} classes ({shown}); this model predicts "
            f"{len(classes)} ({', '.join(classes[:5])}{', …' if len(classes) > 5 else ''}). "
            "Register it under another name (--model-name)."
        )
