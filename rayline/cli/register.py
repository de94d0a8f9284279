"""``rayline register-model``: the model a user already has, whatever they saved it as, as a new version."""

from __future__ import annotations

from rayline.cli import summaries
from rayline.cli.common import JsonOption, before_flow, echo_json, reports_errors
from rayline.cli.request_options import request_options
from rayline.ray_workloads.registration.request import RegisterRequest


@reports_errors
@request_options(RegisterRequest, {"weights_uri": "--weights", "draft": "--draft/--full-decode"})
def register_model_command(request: RegisterRequest, as_json: JsonOption = False) -> None:
    """Register a model you already have (see the README's "Bring your model"), as a new version."""
    before_flow(quiet=False)
    from rayline.flows.register_model import register_model

    result = register_model(request)
    echo_json(result) if as_json else summaries.print_registration(result)
