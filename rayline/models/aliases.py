"""One alias move: a compare-and-swap on the alias's file (``rayline.storage.conditional``), never a blind write.

The move reads the alias with its token and replaces exactly what it read (``If-Match`` on S3, a lock around
read-compare-replace locally), or creates it if there was none (``If-None-Match: *``). A move that loses raises
``AliasConflict`` naming the winner; nothing is overwritten, and a move's ``previous`` is the version it replaced. Which
moves are allowed (a committed version, the champion only by its rollout) is ``rayline.models.registry``'s.
"""

from __future__ import annotations

import enum
from datetime import UTC, datetime

from pydantic import BaseModel, Field

from rayline.errors import AliasConflict
from rayline.storage import conditional


class AliasMove(BaseModel):
    """What an alias file holds: the move that put the alias where it is."""

    name: str
    alias: str
    version: int
    previous: int | None
    reason: str
    moved_at: datetime = Field(default_factory=lambda: datetime.now(UTC))


class Unchecked(enum.Enum):
    """``expected=Unchecked.ANY``: the move was decided against no particular version of the alias."""

    ANY = "any"


def swap(
    uri: str, name: str, alias: str, version: int, reason: str, expected: int | None | Unchecked = Unchecked.ANY
) -> AliasMove:
    """Move ``alias`` of model ``name`` (its file at ``uri``) to ``version``, replacing only what was read.

    ``expected``: the version the move was decided against; anything else there raises ``AliasConflict``. An alias
    already on ``version`` is not moved: the move that put it there is returned.
    """
    read = conditional.read_versioned(uri)
    current = _parsed(read)
    if current is not None and current.version == version:
        return current
    previous = current.version if current is not None else None
    if expected is not Unchecked.ANY and previous != expected:
        raise AliasConflict(
            f"alias {alias} of {name} is now on {_shown(previous)}"
            f"{f' ({current.reason})' if current is not None else ''}, not {_shown(expected)} as when its move "
            f"to v{version} was decided: nothing moved; decide again against {_shown(previous)}",
            current=previous,
        )
    move = AliasMove(name=name, alias=alias, version=version, previous=previous, reason=reason)
    body = move.model_dump_json().encode()
    # moved_at is in the bytes: no two moves write the same ones (tokens are content hashes or ETags)
    written = (
        conditional.create_exclusive(uri, body) if read is None else conditional.replace_if_match(uri, body, read.token)
    )
    if written is not None:
        return move
    winner = _parsed(conditional.read_versioned(uri))
    if winner is not None and winner.version == version:
        return winner  # another writer made the same move: it stands
    raise AliasConflict(
        f"alias {alias} of {name}: another writer moved it to {_shown(winner.version if winner else None)}"
        f"{f' ({winner.reason})' if winner is not None else ''} between this move's read and its write "
        f"(from {_shown(previous)} to v{version}); nothing was overwritten",
        current=winner.version if winner is not None else None,
    )


def _parsed(read: conditional.Versioned | None) -> AliasMove | None:
    return None if read is None else AliasMove.model_validate_json(read.data)


def _shown(version: int | None) -> str:
    return "no version" if version is None else f"v{version}"
