"""Flow ``register-model``: register a model the user already has, whatever they saved it as."""

from __future__ import annotations

from prefect import flow

from rayline.ray_workloads.registration.outside_models import RegisterModelResult
from rayline.ray_workloads.registration.request import RegisterRequest
from rayline.tasks.flow_lineage import openlineage_flow
from rayline.tasks.outside_models import register_outside_model
from rayline.tasks.plans import measure_plan_task


@openlineage_flow
@flow(name="register-model")
def register_model(request: RegisterRequest) -> RegisterModelResult:
    """Check the model file ``request.weights_uri`` and register it as a new version of ``request.name``.

    A state dict names its module (``arch``, or a ``factory`` with its ``code``); a TorchScript, ``.pt2`` or
    ONNX file is the whole model. The classes, the image spec and the sample images come from the request
    (:class:`RegisterRequest`); a size the architecture cannot take is refused before anything is read.
    Then its execution plan is measured on the cluster, so that its first night runs at the speed of its next.
    """
    result = register_outside_model(request)
    measure_plan_task(result.version)
    return result
