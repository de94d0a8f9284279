"""How a model version runs on a machine: ``interface`` (one interface over every kind of model, loaded
once), ``plan`` (its execution plan: precision, layout and backend, chosen by measuring behind an
accuracy gate), ``fallback`` (the batches a plan could not answer in finite numbers, predicted again in
fp32, and when that demotes it), ``cache`` (the plan kept with the version) and ``openvino_backend``.

Imports ``data`` and ``architectures``.
"""
