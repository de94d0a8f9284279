"""The project's own tasks: a Prefect project's usual ``tasks`` package, beside an installed rayline."""
