"""Online serving: Ray Serve deployments, HTTP handling, routing state, driver-side control and rollouts."""
