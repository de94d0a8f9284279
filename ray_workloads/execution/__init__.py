"""How a model version runs on a machine: ``interface`` (one interface over every kind of model, loaded
once), ``plan`` (its execution plan: precision, layout and backend, chosen by measuring behind an
accuracy gate), ``cache`` (the plan kept with the version) and ``openvino_backend``.

Imports ``data`` and ``architectures``.
"""
