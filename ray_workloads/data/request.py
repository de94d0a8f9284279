"""What a ``prepare-data`` run is asked (:class:`PrepareRequest`): declared once, for the CLI's options, the
flow's one parameter and the hourly deployment's, as ``rayline.ray_workloads.nightly.request`` explains."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayline.errors import ConfigError
from rayline.specs import DIGITS_IMAGE_SIZE, ImageSpec, squash


class PrepareRequest(BaseModel):
    """Ingest a prefix and preprocess it for training: decoded with a registered model's image spec (``like``),
    a given one (``image``: a fine-tune's parent's), or squashed to ``image_size`` squares (the digits)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    source_uri: str | None = Field(None, description="Prefix to ingest; default <storage>/raw.")
    image_size: int = Field(DIGITS_IMAGE_SIZE, ge=4, le=1024, description="Square side the images are squashed to.")
    force: bool = Field(False, description="Recompute even if the input is unchanged.")
    like: str | None = Field(
        None, description="Decode with a registered model's image spec instead (NAME@champion, NAME@v3)."
    )
    image: ImageSpec | None = Field(None, description="Decode with this image spec instead.")
    announce_retrain: bool = Field(
        True,
        description="Announce new objects as asking for a retraining; off when the caller trains on them itself.",
    )

    @model_validator(mode="after")
    def _one_image_spec(self) -> PrepareRequest:
        if self.like is not None and self.image is not None:
            raise ConfigError("give like (a registered model's image spec) or image, not both")
        return self

    def image_spec(self, registered: ImageSpec | None) -> ImageSpec:
        """The spec the images are decoded with: ``registered`` (that of ``like``), the request's, else a square."""
        return registered or self.image or squash(self.image_size)
