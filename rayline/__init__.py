"""rayline: Prefect flows orchestrating Ray workloads for an image classifier's whole life."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rayline")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
