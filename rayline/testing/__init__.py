"""Fault drills' tools, shared by the tests and the benchmarks: nothing else in rayline imports them.

- ``s3_server``: a loopback S3-protocol server (moto's, in its own process), free ports, stopping a process;
- ``fault_proxy``: a real HTTP proxy in front of an S3, GCS or Azure endpoint that throttles, fails, resets,
  cuts bodies short and refuses reads by policy (``--help``); ``fault_proxy_control`` starts and configures one;
- ``gcs_server``, ``azurite``: GCS's and Azure's emulators in their own processes;
- ``trained_models``: a ResNet-18 trained on the digits in seconds (real logit margins, for accuracy gates).

The servers are standard library only and the model imports torch inside its function, so an installed
rayline finds them without the test suite or ``bench/`` on the path.
"""
