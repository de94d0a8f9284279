"""``rayline register-model``: the model a user already has, whatever they saved it as, as a new version."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer

from rayline.cli import summaries
from rayline.cli.common import JsonOption, echo_json
from rayline.cli.common import fail as _fail
from rayline.config import apply_process_defaults, get_settings
from rayline.errors import ConfigError, RaylineError


def register_model_command(
    ctx: typer.Context,
    name: Annotated[str, typer.Option(help="Registry name, e.g. photos (lowercase letters, digits, '-').")],
    weights_uri: Annotated[
        str,
        typer.Option(
            "--weights",
            help="The model file or URI: a state dict (torch.save(model.state_dict(), …)), TorchScript, "
            "a torch.export .pt2 program or ONNX (detected from the content).",
        ),
    ],
    arch: Annotated[
        str | None,
        typer.Option(
            help="For a state dict: any torchvision classifier (resnet50, efficientnet_b0, vit_b_16, …) or "
            "timm:<name> (timm.list_models()). Not for TorchScript/.pt2/ONNX: the file is the whole model."
        ),
    ] = None,
    format: Annotated[
        str | None,
        typer.Option(help="state_dict, torchscript, torch_export or onnx; checked against the file's content."),
    ] = None,
    factory: Annotated[
        str | None,
        typer.Option(help="For a state dict of your own class: package.module:callable returning the nn.Module."),
    ] = None,
    factory_kwargs: Annotated[
        str | None, typer.Option(help="JSON keyword arguments of --factory, e.g. '{\"width\": 64}'.")
    ] = None,
    code: Annotated[
        str | None,
        typer.Option(help="The --factory's package folder, stored with the model and shipped to Ray (runtime_env)."),
    ] = None,
    sidecar: Annotated[
        str | None,
        typer.Option(
            help='JSON file/URI: {"classes": [...], "image": {"mode": "resize_crop", "resize": 256, "crop": 224, '
            '"mean": […], "std": […]}} (docs/models.md).'
        ),
    ] = None,
    classes: Annotated[
        str, typer.Option(help="'imagenet' (torchvision's 1,000 names) or a file or storage URI with one name a line.")
    ] = "imagenet",
    preprocess: Annotated[
        str,
        typer.Option(
            help="imagenet: the model's own evaluation transform (torchvision weights entry, timm config, or "
            "resize 256 / crop 224); squash: resize to a square."
        ),
    ] = "imagenet",
    resize: Annotated[int | None, typer.Option(help="Shorter side before the centre crop (imagenet).")] = None,
    crop: Annotated[int | None, typer.Option(help="Side of the square the model sees.")] = None,
    draft: Annotated[
        bool,
        typer.Option(
            "--draft/--full-decode",
            help="Decode JPEGs over twice the needed size at a reduced scale (~4x faster on 12 MP photos, close to "
            "full decoding), or fully: equal to torchvision's transforms().",
        ),
    ] = True,
    samples: Annotated[
        str | None,
        typer.Option(
            help="A folder or URI prefix of a few of the model's own images (the first 32 are kept): the execution "
            "plan's accuracy gate is judged on them. Without it, on stand-in photos."
        ),
    ] = None,
    alias: Annotated[
        str | None, typer.Option(help="Alias to point at it: champion, or challenger to canary it.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Register a model you already have (see the README's "Bring your model"), as a new version."""
    apply_process_defaults()
    from rayline.flows.register_model import register_model

    try:
        get_settings()
        if preprocess not in ("imagenet", "squash"):
            raise ConfigError(f"--preprocess must be imagenet or squash, got {preprocess!r}")
        if format not in (None, "state_dict", "torchscript", "torch_export", "onnx"):
            raise ConfigError(f"--format must be state_dict, torchscript, torch_export or onnx, got {format!r}")
        params = {k: v for k, v in ctx.params.items() if k != "as_json"}
        params["factory_kwargs"] = _json_object("--factory-kwargs", factory_kwargs)
        result = register_model(**params)  # the options are the flow's parameters, named alike
    except RaylineError as exc:
        _fail(exc)
    echo_json(result) if as_json else summaries.print_registration(result)


def _json_object(option: str, text: str | None) -> dict[str, Any] | None:
    """A JSON object given on the command line, or a ConfigError naming the option."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{option} must be a JSON object, e.g. '{{\"width\": 64}}': {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{option} must be a JSON object, got {type(value).__name__}")
    return value
