"""``rayline register-model``: the model a user already has, whatever they saved it as, as a new version."""

from __future__ import annotations

from rayline.cli import summaries
from rayline.cli.common import JsonOption, echo_json
from rayline.cli.common import fail as _fail
from rayline.cli.request_options import request_options
from rayline.config import apply_process_defaults, get_settings
from rayline.errors import RaylineError
from rayline.ray_workloads.registration.request import RegisterRequest


@request_options(RegisterRequest, {"weights_uri": "--weights", "draft": "--draft/--full-decode"})
def register_model_command(request: RegisterRequest, as_json: JsonOption = False) -> None:
    """Register a model you already have (see the README's "Bring your model"), as a new version."""
    apply_process_defaults()
    from rayline.flows.register_model import register_model

    try:
        get_settings()
        result = register_model(request)
    except RaylineError as exc:
        _fail(exc)
    echo_json(result) if as_json else summaries.print_registration(result)
