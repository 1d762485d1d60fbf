"""The referee reads NVML at every window's edge, so a window is measured from its own
time alone (vgpu.referee)."""
import time

from vgpu.referee import POLL_S, poll_times


def test_reads_fall_on_every_window_edge_and_never_further_apart_than_a_poll():
    t0 = time.time() + 0.05
    windows = [[2.0, 2.1], [0.5, 1.8], [2.1, 3.1], [0.5, 1.8]]
    times = poll_times(windows, t0)
    assert times == sorted(times) and len(set(times)) == len(times)
    for edge in {t0 + x for w in windows for x in w}:
        assert any(abs(t - edge) < 1e-9 for t in times), edge
    gaps = [b - a for a, b in zip([time.time()] + times, times)]
    assert max(gaps) <= POLL_S + 0.01
    assert times[-1] == t0 + 3.1


def test_edges_already_past_are_not_read_again():
    t0 = time.time() - 10
    assert poll_times([[1.0, 2.0]], t0) == []
