"""Versions from outside and to the outside: ``outside_models`` registers a user's model file,
checked before anything is stored; ``mlflow_models`` and ``mlflow_pyfunc`` mirror versions to MLflow.

Imports ``data``, ``architectures`` and ``execution``.
"""
