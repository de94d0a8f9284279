"""Models: the registry of trained models and what mirrors it.

- ``registry``: immutable versions, movable aliases (``champion``, ``challenger``);
- ``promotion_gate``: whether a candidate beats the champion on its test split (exact McNemar);
- ``aliases``: one alias move as a compare-and-swap;
- ``class_lists``: the rule a new version's classes keep (every class of its versions at the same index);
- ``split_answers``: a version's answers on a test split, image by image, kept with it, and the exact McNemar
  test on two versions' answers that the gate asks;
- ``tracking``, ``mlflow_mirror``: MLflow tracking of Train runs, and the registry mirrored into MLflow's
  (how a version becomes an MLflow model is the caller's ``save_model``:
  ``rayline.ray_workloads.registration.mlflow_models``).

It imports ``rayline.storage`` and the cross-cutting modules (a model's spec is ``rayline.specs``):
never ``rayline.tables`` or ``rayline.lineage``.
"""
