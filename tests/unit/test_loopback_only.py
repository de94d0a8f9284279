"""The suite runs where only the loopback exists (``make test`` wraps pytest in ``tests/loopback-only``)."""

from __future__ import annotations

import errno
import os
import socket

import pytest

pytestmark = pytest.mark.unit

METADATA_ADDRESS = ("169.254.169.254", 80)


def test_the_cloud_metadata_address_is_unreachable_from_the_suite() -> None:
    """A UDP socket's connect only looks up a route (no packet is sent): where the namespace exists it fails at
    once with "Network is unreachable"; elsewhere the address is routable, which CI must never be."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(METADATA_ADDRESS)
    except OSError as exc:
        assert exc.errno == errno.ENETUNREACH, exc
        assert [name for _, name in socket.if_nameindex()] == ["lo"]
        return
    finally:
        probe.close()
    message = "169.254.169.254 is routable: the suite is not in tests/loopback-only's network namespace"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)
