"""Quality: whether a model is still right on the photos it predicts, measured against people's labels.

``labels_import`` appends checked labels files; ``metrics`` and ``reading`` measure each version night by
night; ``paired`` tests a challenger against the champion; ``shadow`` compares a night's shadow version with
the champion; ``queue`` chooses what to label next; ``training_set`` exports the labelled photos for training.

Imports no other stage package; ``nightly``, ``training``, ``serving`` and ``monitoring`` import it.
"""
