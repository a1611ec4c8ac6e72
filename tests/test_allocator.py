"""The allocator setting training and data building apply (models/allocator.py)."""

from __future__ import annotations

import platform

from models.allocator import keep_freed_memory, release_freed_memory


def test_glibc_takes_the_setting_and_other_libcs_are_left_alone():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc


def test_freed_memory_goes_back_only_past_the_given_share_of_the_machine():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert release_freed_memory(fraction=1.0) is False  # no process holds more than all of the machine
    assert release_freed_memory(fraction=0.0) is glibc


def test_a_libc_other_than_glibc_is_left_alone(monkeypatch):
    """musl / macOS / Windows hosts (simulated): neither call touches the allocator."""
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert keep_freed_memory() is False
    assert release_freed_memory(fraction=0.0) is False
