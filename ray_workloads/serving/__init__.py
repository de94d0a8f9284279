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

A rollout (``rollout``, and ``canary`` for the registry's side: the incumbent, the champion
alias a promotion moves; the serve-rollout flow's tasks call them step by step)::

    prepare    Serve, ServeControl and the Router up; weight a dead rollout    control, applications
               left off the champion goes back to it (canary.reconcile); the
               incumbent, the champion, serves (at 100 % if nothing of its
               model did); the candidate at 0 %
    each step  first step only: agreement, the same images pinned to both
    (10, 50,   set_weights {incumbent: 100 - w, candidate: w}: one new table
     100 %)    generation, returned once every router routes by it
               soak: unpinned probes through the router for soak_s (up to
               3× longer until the candidate has min_requests answers)
               judge the window's gated stats (routed, not 4xx): error rate,
               p95 against the incumbent's, at least min_requests answers
    all pass   retire: the candidate at 100 %, the old version's app deleted
    one fails  roll_back: the incumbent at 100 %, the candidate's app deleted

``champion`` judges serving against the registry: the version with the most traffic should be the
champion. Imports ``data``, ``execution`` and ``monitoring``. Nothing is imported here: the control
actor imports ``routing`` alone, without Serve's HTTP stack or torch.
"""
