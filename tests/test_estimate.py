"""Memory: the measured peak (`_peak.PeakMeter`) and `sf.estimate_memory` against it."""

from __future__ import annotations

import torch

from shardfn._peak import PeakMeter


def test_peak_meter_counts_known_tensors():
    meter = PeakMeter()
    with meter:
        keep = torch.empty(1 << 20)  # 4 MiB, live through both sections
        with meter.section("alloc"):
            a = torch.ones(4 << 20)  # 16 MiB
            b = torch.ones(2 << 20)  # 8 MiB: the peak is 4 + 16 + 8
            del a
            c = torch.ones(1 << 20)
            del b, c
        with meter.section("resize"):
            s = keep.untyped_storage()
            s.resize_(0)
            s.resize_(40 << 20)  # a storage resized in place, as the unit buffers are
            s.resize_(0)
    mib = 1 << 20
    assert (meter["alloc"].start, meter["alloc"].peak) == (4 * mib, 28 * mib)
    assert (meter["resize"].start, meter["resize"].peak) == (4 * mib, 40 * mib)
    # RSS sees the pages written (ones), not those only reserved (resize_): 24 MiB and a little.
    assert 24 * mib <= meter["alloc"].rss_growth < 26 * mib
