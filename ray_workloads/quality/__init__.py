"""Quality: whether a model is still right on the photos it predicts, measured against people's labels.

``labels_import`` checks a labels file against the model's nights and appends it to the ``labels`` table;
``metrics`` measures each version night by night on the labelled photos; ``paired`` tests a challenger
against the champion on the photos both predicted (a sequential test: passed, failed or inconclusive).

Imports no other stage package; ``training`` and ``serving`` import it for their gates.
"""
