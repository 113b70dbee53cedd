"""`ringfeed shard`'s progress (shards/progress.py): silent unless asked or on a terminal,
counts added from any process, and the units it prints."""

from __future__ import annotations

import pytest

from ringfeed.shards.progress import Progress, human_bytes, rate


@pytest.mark.parametrize("n, text", [(0, "0 B"), (999, "999 B"), (1000, "1.0 KB"),
                                     (61_440, "61.4 KB"), (2.5e9, "2.5 GB"), (3e12, "3.0 TB"),
                                     (5e15, "5000.0 TB")])
def test_sizes_in_decimal_units(n, text):
    assert human_bytes(n) == text


def test_rate_is_megabytes_a_second_and_survives_zero_seconds():
    assert rate(50_000_000, 2.0) == "25.0 MB/s"
    assert rate(1, 0.0).endswith(" MB/s")


def test_a_disabled_bar_counts_nothing_and_prints_nothing(capsys):
    p = Progress(100, enabled=False)
    p.on_sample(10)
    p.refresh()
    p.close()
    assert capsys.readouterr().err == ""


def test_an_enabled_bar_counts_samples_and_bytes(capsys):
    p = Progress(3, enabled=True)
    for size in (100, 200, 300):
        p.on_sample(size)
    p.close()
    err = capsys.readouterr().err
    assert "3/3" in err and "MB/s" in err
