"""The rule that keeps a model's class indices comparable across its versions.

Labels and predictions are joined and compared by class index, across versions (the paired test,
accuracy per version, a shadow beside the champion): an index must name the same class in every
version of a model, or a better version would measure worse. So a new version keeps every class of
the model's versions at the same index; it may add classes after them.
"""

from __future__ import annotations

from rayline.errors import InputDataError


def first_moved_class(kept: list[str], classes: list[str]) -> int | None:
    """The first index of ``kept`` where ``classes`` names another class or none; None when it keeps them all."""
    for at, label in enumerate(kept):
        if at >= len(classes) or classes[at] != label:
            return at
    return None


def check_kept(name: str, classes: list[str], versions: dict[int, list[str]]) -> None:
    """Refuse (``InputDataError``) a new version of ``name`` listing ``classes`` that moves or drops a class of
    one of its ``versions`` (number → class list), naming both lists and the first index that differs."""
    for number, kept in sorted(versions.items()):
        at = first_moved_class(kept, classes)
        if at is None:
            continue
        now = repr(classes[at]) if at < len(classes) else "none"
        raise InputDataError(
            f"a new version of model {name} must keep the classes of its versions at the same indices (it may "
            f"add classes after them): {name} v{number} lists {_shown(kept, at)}, the new version "
            f"{_shown(classes, at)}; they differ at index {at} ({kept[at]!r} in {name} v{number}, {now} in the new "
            "version). Labels and predictions are compared by class index: reorder the new version's classes "
            "(and its output layer) to match, or register it as a model of another name"
        )


def _shown(classes: list[str], at: int, most: int = 20) -> str:
    """A class list as text: whole when short, else the few around index ``at`` and how many there are."""
    if len(classes) <= most:
        return str(classes)
    start = max(0, at - 3)
    window = ", ".join(f"{i}: {c!r}" for i, c in enumerate(classes[start : start + 7], start))
    return f"[… {window} …] ({len(classes)} classes)"
