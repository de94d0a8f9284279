"""Versions from outside and to the outside: ``outside_models`` registers a user's model file,
checked before anything is stored; ``mlflow_models`` mirrors versions to MLflow as ``mlflow_pyfunc`` (which
imports nothing of rayline) over the ONNX file ``onnx_export`` makes of each.

Imports ``data``, ``architectures`` and ``execution``.
"""
