"""Input data: ``ingest`` (objects listed and fetched into Parquet shards), ``preprocess`` (decoded
train/val/test shards) and ``images`` (decoding one photo at the size a model needs).

Imports no other stage package.
"""
