"""The orchestrator's burst admission (orchestrator.admission): when it waits, and for how long."""

from orchestrator.admission import BurstConfig, BurstGate

CFG = BurstConfig(window_s=0.010, gap_s=0.001)


def test_a_lone_request_starts_at_once():
    gate = BurstGate(CFG)
    gate.arrived(1.0)
    assert not gate.open(1.0001, waiting=1)
    gate.arrived(1.5)  # the next one, long after: still no burst
    assert not gate.open(1.5001, waiting=1)


def test_requests_waiting_together_wait_until_the_burst_stops():
    gate = BurstGate(CFG)
    gate.arrived(2.0)
    gate.arrived(2.0002)
    assert gate.open(2.0003, waiting=2)
    assert gate.until(2.0003) == 2.0002 + CFG.gap_s  # the gap after the last arrival
    gate.arrived(2.0008)
    assert gate.until(2.0009) == 2.0008 + CFG.gap_s
    assert gate.until(2.0008 + CFG.gap_s + 1e-6) is None  # quiet for a gap: start


def test_the_wait_never_passes_the_window():
    gate = BurstGate(CFG)
    gate.arrived(3.0)
    gate.arrived(3.0)
    assert gate.open(3.0, waiting=2)
    for i in range(1, 30):  # requests keep coming, each within the gap of the last
        gate.arrived(3.0 + i * 0.0005)
    assert gate.until(3.0145) is None
    assert gate.until(3.009) == 3.0 + CFG.window_s


def test_a_burst_makes_the_next_start_from_idle_wait_for_its_followers():
    """A closed loop of requests that end together: the first of the next burst reaches the
    idle scheduler alone, but the last burst's arrivals were close together, so it waits."""
    gate = BurstGate(CFG)
    gate.arrived(4.0)
    assert not gate.open(4.0, waiting=1)
    gate.arrived(4.0004)  # a follower within the gap, joining the round in flight
    gate.arrived(4.5)  # later, from idle, alone in the queue
    assert gate.open(4.5, waiting=1)
    assert not gate.open(5.5, waiting=1)  # nothing came close together since: no wait


def test_a_start_that_took_in_several_makes_the_next_lone_wake_wait():
    """The closed loop's next burst when every request of the last one arrived before the
    wake: its first request wakes the scheduler alone and waits for the rest; a lone start
    that gathered nobody ends that."""
    gate = BurstGate(CFG)
    for t in (8.0, 8.0001, 8.0002):
        gate.arrived(t)
    assert gate.open(8.0003, waiting=3)
    gate.started(3)
    gate.arrived(9.0)  # the next burst's first, alone at the wake
    assert gate.open(9.0001, waiting=1)
    assert gate.until(9.0001) == 9.0 + CFG.gap_s
    gate.started(1)  # nobody came within the gap
    gate.arrived(10.0)
    assert not gate.open(10.0001, waiting=1)  # one client at a time: no wait again


def test_window_zero_never_waits():
    gate = BurstGate(BurstConfig(window_s=0.0))
    gate.arrived(1.0)
    gate.arrived(1.0)
    assert not gate.open(1.0, waiting=2)


def test_in_burst_says_whether_requests_are_coming_together():
    gate = BurstGate(CFG)
    gate.arrived(6.0)
    gate.arrived(6.0005)
    assert gate.in_burst
    assert gate.open(6.001, waiting=2)  # a wake that waits for its burst: in one
    assert gate.in_burst
    gate.started(2)
    gate.arrived(7.0)
    assert gate.open(7.0001, waiting=1)  # after a start of two, the next lone wake waits too
    assert gate.in_burst
    gate.started(1)
    gate.arrived(8.0)  # alone, and the last start was alone: a new watch
    assert not gate.open(8.0001, waiting=1)
    assert not gate.in_burst
    gate.arrived(8.0002)  # a second one within the gap
    assert gate.in_burst
