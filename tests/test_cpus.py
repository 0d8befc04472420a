"""flashmap.cpus: CPU lists, the stack's split and pinning a thread."""

from __future__ import annotations

import os
import threading

import pytest

from flashmap.cpus import (
    format_cpu_list,
    on_cpus,
    parse_cpu_list,
    pin_thread,
    pin_worker,
    split_cpus,
)


def test_cpu_lists_round_trip():
    assert parse_cpu_list("0-2,5") == {0, 1, 2, 5}
    assert parse_cpu_list(" 3 ") == {3}
    assert format_cpu_list({5, 0, 2, 1}) == "0-2,5"
    assert format_cpu_list({7}) == "7"
    for text in ("0", "0-3", "1,3,5-7", "0-1,4-5"):
        assert format_cpu_list(parse_cpu_list(text)) == text


@pytest.mark.parametrize("bad", ["", ",", "3-1", "-1", "a", "0-"])
def test_bad_cpu_lists_are_refused(bad):
    with pytest.raises(ValueError):
        parse_cpu_list(bad)


def test_split_gives_the_target_the_first_cpus_and_keeps_one_for_the_rest():
    assert split_cpus(1, {0, 1}) == ({0}, {1})
    assert split_cpus(8, {0, 1, 2, 3}) == ({0, 1, 2}, {3})  # never all of them
    assert split_cpus(0, {4, 6, 9}) == ({4}, {6, 9})  # at least one
    assert split_cpus(2, {12, 3, 7, 5}) == ({3, 5}, {7, 12})  # a container's cpuset, in order
    assert split_cpus(1, {0}) is None  # nothing to split


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 usable CPUs")
def test_pinning_applies_to_the_calling_thread_only_and_is_restored():
    cpus = sorted(os.sched_getaffinity(0))
    seen = {}

    def worker():
        pin_thread({cpus[0]})
        seen["worker"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["worker"] == {cpus[0]}
    assert os.sched_getaffinity(0) == set(cpus)  # the main thread is untouched
    with on_cpus({cpus[1]}):
        assert os.sched_getaffinity(0) == {cpus[1]}
    assert os.sched_getaffinity(0) == set(cpus)
    with on_cpus(None):
        assert os.sched_getaffinity(0) == set(cpus)


def test_a_worker_that_cannot_be_pinned_says_why_and_runs_where_it_was():
    seen = {}

    def worker():
        before = os.sched_getaffinity(0)
        seen["none"] = pin_worker(None, "worker")
        seen["bad"] = pin_worker({4000}, "forward thread")  # no such CPU
        seen["kept"] = os.sched_getaffinity(0) == before
        seen["good"] = pin_worker({min(before)}, "worker")
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["none"] == "" and seen["good"] == "" and seen["kept"]
    assert seen["bad"].startswith("cannot run the forward thread on CPUs 4000: ")
    assert seen["after"] == {min(os.sched_getaffinity(0))}
