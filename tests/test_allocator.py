"""The allocator setting training and data building apply (models/allocator.py)."""

from __future__ import annotations

import platform

from models.allocator import keep_freed_memory


def test_glibc_takes_the_setting_and_other_libcs_are_left_alone():
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is glibc
