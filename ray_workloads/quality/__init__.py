"""Quality: whether a model is still right on the photos it predicts, measured against people's labels.

``labels_import`` checks a labels file against the model's nights and appends it to the ``labels`` table;
``metrics`` measures each version night by night on the labelled photos (``reading``: served and shadow
nights, what the monitor and the gates ask); ``paired`` tests a challenger against the champion on the
photos both predicted (a sequential test: passed, failed or inconclusive); ``shadow`` compares a version
scored in a night's shadow with the champion; ``queue`` chooses what to label next; ``training_set``
copies the labelled photos out as training input.

Imports no other stage package; ``nightly`` imports it for its shadow, ``training`` and ``serving`` for
their gates, ``monitoring`` for its figures.
"""
