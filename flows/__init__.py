"""rayline's Prefect flows, one module each, named as its flow: ``from rayline.flows.nightly_inference import
nightly_inference``. Run them as they are or as subflows of a flow of your own (docs/api.md).

Nothing is imported here: a flow loads Prefect, Ray and the stages, and a command loads only its own.
"""

__all__ = [
    "import_labels",
    "monitor",
    "nightly_inference",
    "prepare_data",
    "queue_labels",
    "register_model",
    "serve_rollout",
    "train_model",
]
