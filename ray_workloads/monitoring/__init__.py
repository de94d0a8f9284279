"""Monitoring: ``monitor`` (drift of a model's nights against a reference, and serving health, as checks),
``prometheus`` (the reading, labelled quality included, as Prometheus series), ``charts`` (the plots its
Prefect artifacts show) and ``thresholds`` (the limits its checks judge by, which the request reads without Ray
Data).

Imports ``data`` and ``quality``.
"""
