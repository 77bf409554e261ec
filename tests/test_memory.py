"""The chunked path's peak host memory is a small fraction of the full-logits reference's (Linux only)."""

import os

import pytest

from fastgrpo.bench.cpu_memory import run_isolated


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
def test_reference_peak_holds_at_least_its_logits():
    """The same measurement at a small size (one child process, a few seconds): the full-logits reference's peak
    above its inputs is at least its [N, V] fp32 logits, and the row names its sizes."""
    row = run_isolated("reference", 512, 16, 16384)
    assert (row["method"], row["tokens"], row["hidden"], row["vocab"]) == ("reference", 512, 16, 16384)
    assert row["logits_bytes"] == 512 * 16384 * 4
    assert row["peak_extra_bytes"] >= row["logits_bytes"], row


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc/self/clear_refs")
@pytest.mark.slow
def test_chunked_peak_memory_under_10_percent_of_reference():
    chunked = run_isolated("chunked", 8192, 256, 65536)
    full = run_isolated("reference", 8192, 256, 65536)
    ratio = chunked["peak_extra_bytes"] / full["peak_extra_bytes"]
    print(f"\npeak above inputs, N=8192 H=256 V=65536 fp32: chunked {chunked['peak_extra_bytes'] / 2**20:.0f} MiB, "
          f"reference {full['peak_extra_bytes'] / 2**20:.0f} MiB, ratio {ratio:.3f}")
    assert full["peak_extra_bytes"] > chunked["logits_bytes"], "the reference must at least hold the logits"
    assert ratio < 0.10
