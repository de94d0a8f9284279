"""The stages: plain typed ``run(cfg) -> result`` functions over Ray, with no Prefect import.

Grouped by concern, each a package that imports only those below it::

    nightly/        a night's batch inference into the Delta tables
    serving/        Ray Serve: the router, model servers, rollouts and the champion's alias
    monitoring/     drift of the nights and serving health, as checks and Prometheus series
    quality/        labels back, each version's labelled accuracy, the paired challenger test, shadow
                    comparisons, what to label next, labelled photos as training input
    training/       tuning, training, evaluation and the promotion gate
    registration/   outside models as versions, and versions as MLflow models
    data/           ingest, preprocessing and image decoding
    execution/      how a version runs on a machine: the one model interface, its plan, measured and cached
    architectures/  the modules rayline builds and the model files it runs

Above them the Prefect tasks (``tasks/``) call one stage each; below them, the core (``rayline``).
"""
