"""glibc malloc settings for batch-building processes (pipeline/malloc.py): applied once per
process, and never where RINGFEED_MALLOC_TUNING=0 asks malloc to be left alone. (The module
keeps whether it tuned in a module global; each test starts from "not tuned".)"""

from __future__ import annotations

import platform

import pytest

from ringfeed.pipeline import malloc

GLIBC = platform.libc_ver()[0] == "glibc"


@pytest.fixture(autouse=True)
def untuned(monkeypatch):
    monkeypatch.setattr(malloc, "_tuned", False)


def test_tuning_off_leaves_malloc_alone(monkeypatch):
    monkeypatch.setenv("RINGFEED_MALLOC_TUNING", "0")
    calls = []
    monkeypatch.setattr(malloc.ctypes, "CDLL", lambda *a, **k: calls.append(a))
    assert malloc.tune() is False and calls == []


@pytest.mark.skipif(not GLIBC, reason="mallopt is glibc's")
def test_glibc_takes_the_settings_once(monkeypatch):
    monkeypatch.delenv("RINGFEED_MALLOC_TUNING", raising=False)
    assert malloc.tune() is True
    monkeypatch.setattr(malloc.ctypes, "CDLL", lambda *a, **k: pytest.fail("tuned twice"))
    assert malloc.tune() is True
