"""Monitoring: ``monitor`` (drift of a model's nights against a reference, and serving health, as checks
and Prometheus series) and ``charts`` (the plots its Prefect artifacts show).

Imports ``data``.
"""
