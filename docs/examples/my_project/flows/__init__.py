"""The project's own flows: a Prefect project's usual ``flows`` package, beside an installed rayline."""
