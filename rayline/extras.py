"""How an error tells its reader to install one of rayline's optional extras.

rayline installs from its clone, not from a package index: ``pip install 'rayline[gcs]'`` would look for it on
PyPI, so the hint names the clone's folder, as the README's install line does.
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """The command that adds ``extra`` (``gcs``, ``onnx``…) to the virtualenv rayline is installed in."""
    return f"pip install '.[{extra}]' from rayline's clone (its {extra} extra)"
