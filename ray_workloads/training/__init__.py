"""Training a model: ``tune`` (Ray Tune, ASHA), ``train`` (Ray Train), ``loop`` (one worker's epochs),
``evaluate`` (the test split) and ``promotion`` (register and gate). Imports ``data``, ``architectures`` and
``execution``.
"""
