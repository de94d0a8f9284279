"""Programs the e2e tests run against `rayline up`, each in a process of its own, as a user's script would.

Each is ``python -m tests.e2e.programs.<name> [args]`` from the repository root (``platform_support.run_program``
starts them so); it talks to the platform through the environment the test hands it (``PREFECT_API_URL``,
``RAY_ADDRESS``), and prints what the test asserts on. A process of their own because Prefect's client and
Ray's state API must see that environment, not the test's own.
"""
