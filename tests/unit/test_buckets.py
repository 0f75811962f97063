"""Bucket assignment: a pure function with a table of cases (as in DDP)."""

from __future__ import annotations

import pytest

from allreduce.buckets import assign_buckets

MB = 2**20

CASES = [
    # sizes (bytes, in parameter order), cap, first cap, groups, expected buckets
    ("one param", [10], 100, None, None, [[0]]),
    ("all fit one bucket", [10, 20, 30], 100, None, None, [[2, 1, 0]]),
    ("reverse order, cap closes", [40, 40, 40, 40], 80, None, None, [[3, 2], [1, 0]]),
    ("small first bucket", [40, 40, 40, 40], 100, 40, None, [[3], [2, 1, 0]]),
    ("oversized param alone", [10, 500, 10], 100, None, None, [[2, 1], [0]]),
    ("one bucket per parameter", [4, 8, 16], 1, 1, None, [[2], [1], [0]]),
    ("leftover bucket last", [30, 30, 30], 50, None, None, [[2, 1], [0]]),
    ("dtype groups never mix", [10, 10, 10, 10], 100, None, ["f32", "f64", "f32", "f64"],
     [[3, 1], [2, 0]]),
    ("groups each get a small first bucket", [50] * 6, 1000, 50, ["a", "b"] * 3,
     [[5], [4], [3, 1], [2, 0]]),
    ("empty model", [], 100, None, None, []),
    ("zero-size parameter", [0, 10], 100, None, None, [[1, 0]]),
]


@pytest.mark.parametrize("name,sizes,cap,first,groups,expected", CASES, ids=[c[0] for c in CASES])
def test_assign_buckets(name, sizes, cap, first, groups, expected):
    buckets = assign_buckets(sizes, cap, first, groups)
    assert buckets == expected
    assert sorted(i for b in buckets for i in b) == list(range(len(sizes)))


def test_mlp_wide_default_caps():
    # 784x4096, 4096, 4096x4096, 4096, 4096x10, 10 in float32
    sizes = [784 * 4096 * 4, 4096 * 4, 4096 * 4096 * 4, 4096 * 4, 4096 * 10 * 4, 10 * 4]
    buckets = assign_buckets(sizes, 25 * MB, 1 * MB)
    # As in DDP, a bucket closes once it holds its cap: the last layers' gradients (176 KiB,
    # ready first) stay open below 1 MiB until the 64 MiB weight joins them, so the "small"
    # first bucket holds 64 MiB, and the rest (12.3 MiB) stay below 25 MiB in the last.
    assert buckets == [[5, 4, 3, 2], [1, 0]]


@pytest.mark.parametrize("args", [([10], 0, None), ([10], 10, 0), ([-1], 10, None)])
def test_bad_arguments_raise(args):
    with pytest.raises(ValueError):
        assign_buckets(*args)


def test_group_count_must_match():
    with pytest.raises(ValueError, match="group keys"):
        assign_buckets([1, 2], 10, None, ["a"])
