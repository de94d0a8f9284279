"""Monitoring: ``monitor`` (drift of a model's nights against a reference, and serving health, as checks),
``prometheus`` (the reading, labelled quality included, as Prometheus series) and ``charts`` (the plots its
Prefect artifacts show).

Imports ``data`` and ``quality``.
"""
