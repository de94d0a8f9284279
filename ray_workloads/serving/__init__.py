"""Online serving: one HTTP router in front of one Ray Serve application per live model version.

On the cluster, for an instance named ``rayline`` (``config.ServeConfig.name``)::

    rayline               Router replicas, route "/"                           ingress
    rayline-<model>-v<N>  ModelServer replicas of one version, no route        model_server
    rayline-control       ServeControl, a detached actor: the routing table    routing, stats
                          {model: {version: weight}} and the request stats

A request (``POST /models/<name>/predict``; ``/predict`` for the default model)::

    client ─▶ Serve proxy ─▶ Router: body and multipart limits                 ingress, http_api
                             version: X-Rayline-Version pins one, else a draw
                             by the model's weights (one X-Rayline-Key, one
                             version)                                          routing.choose_version
                               │
                               ▼
                             ModelServer: decode, batch, forward, top-k        model_server
                               │
    client ◀─ JSON answer ◀─ Router: a sample (latency, outcome, pinned or not)
                               │ every SYNC_INTERVAL_S: samples in, table out
                               ▼
                             ServeControl: routing table, StatsBook            routing, stats

``rollout`` steps a candidate's weight and judges it by ``rollout_config`` (plain models, which the request
reads without Ray Serve); ``canary`` is the registry's side (the incumbent, the champion alias); ``champion``
checks that the version with the most traffic is the champion. Imports ``data``, ``execution`` and
``monitoring``; nothing here, so the control actor loads ``routing`` alone, without torch.
"""
