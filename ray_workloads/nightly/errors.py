"""The nights' errors, a branch of the tree in ``rayline/errors.py`` (which names them)."""

from __future__ import annotations

from rayline.errors import RaylineError
from rayline.ray_workloads.nightly.request import BackfillResult


class NightsFailed(RaylineError):
    """Some nights of a range failed (the others committed): the run ends Failed, naming them; ``result`` holds
    every night's outcome, for a caller that reports them."""

    def __init__(self, result: BackfillResult) -> None:
        super().__init__(result.failure_message())
        self.result = result

    def __reduce__(self) -> tuple[type[NightsFailed], tuple[BackfillResult]]:
        # Exception pickles only ``args``: keep the outcomes when Prefect copies the exception
        return (type(self), (self.result,))
