"""What the benchmark entry points in ``bench/`` build on: their data sets, children and reports.

Only ``bench/*.py`` imports these (each entry point is named, with its command, in bench/README.md);
the S3 server and fault proxy they share with the tests are ``rayline.testing``.
"""
