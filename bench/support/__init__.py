"""What the benchmark entry points in ``bench/`` build on: their data sets, children and reports.

Only ``bench/*.py`` imports these; the S3 server and fault proxy they share with the tests are ``rayline.testing``.
"""
