"""How a model version runs on a machine: its execution plan (plan), measured once, cached with the version (cache)."""
