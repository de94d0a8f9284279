"""A night's batch inference: ``batch_inference.run`` is the stage; ``request`` what a run is asked (a night
or a range, in a shape) and what a range answers; ``contract`` its typed config, result and outcomes;
``pipeline`` the Ray Data pipeline; ``blocks`` the blocks cut from the listing and written once each;
``holding`` the night's lease and each holder's listing; ``predictor`` the actors' model call;
``compaction`` the files the tables commit.

A shadowed night scores a second version in the same pass (``rayline.ray_workloads.quality.shadow``).
Imports ``data``, ``execution`` and ``quality``.
"""
