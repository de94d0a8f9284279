"""The test servers' own installs: one cut short is repaired, not used."""

from __future__ import annotations

from pathlib import Path

import pytest

from rayline.testing import azurite

pytestmark = pytest.mark.unit


def test_an_azurite_install_cut_short_is_not_taken_for_a_working_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """npm stopped mid-install leaves ``azurite-blob`` without a module it loads: .ci/run must install again."""
    broken = tmp_path / "azurite-blob"
    broken.write_text("#!/bin/sh\necho \"Error: Cannot find module '@azure/msal-node'\" >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("RAYLINE_AZURITE", str(broken))
    monkeypatch.setattr(azurite, "_TOOLS", tmp_path / "no-install")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))

    assert azurite.azurite_binary() == str(broken)  # it is there
    assert azurite.working_azurite() is None  # but it does not run

    fixed = tmp_path / "fixed" / "azurite-blob"
    fixed.parent.mkdir()
    fixed.write_text("#!/bin/sh\necho 3.37.0\n")
    fixed.chmod(0o755)
    monkeypatch.setenv("RAYLINE_AZURITE", str(fixed))
    assert azurite.working_azurite() == str(fixed)
