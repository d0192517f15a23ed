"""Admission filters: a key is admitted on its threshold-th offer; refused
parents stop their children; bad settings name themselves."""

import pytest

from kvoffload.config import ConfigError
from kvoffload.tiering.admission import StoreCountAdmission, TinyLFUAdmission


def K(i: int) -> bytes:
    return i.to_bytes(8, "big") + b"\0\0\0\0"


@pytest.mark.parametrize("cls", [StoreCountAdmission, TinyLFUAdmission])
def test_second_offer_admits(cls):
    f = cls(threshold=2)
    assert f.admit([K(1), K(2)]) == []
    assert f.admit([K(1), K(2)]) == [K(1), K(2)]
    assert f.admit([K(3)]) == []


@pytest.mark.parametrize("cls", [StoreCountAdmission, TinyLFUAdmission])
def test_prefix_closed_stops_at_the_first_refused_key(cls):
    f = cls(threshold=2)
    f.admit([K(1), K(2)])
    assert f.admit([K(1), K(9), K(2)]) == [K(1)]
    g = cls(threshold=2, prefix_closed=False)
    g.admit([K(1), K(2)])
    assert g.admit([K(1), K(9), K(2)]) == [K(1), K(2)]


@pytest.mark.parametrize("cls", [StoreCountAdmission, TinyLFUAdmission])
def test_threshold_one_admits_everything(cls):
    assert cls(threshold=1).admit([K(5), K(6)]) == [K(5), K(6)]


def test_store_count_memory_is_bounded_and_keeps_recent_counts():
    f = StoreCountAdmission(threshold=2, memory=10)
    f.admit([K(1)])
    for i in range(100, 104):
        f.admit([K(i)])
    assert f.admit([K(1)]) == [K(1)]  # still remembered (previous generation)
    for i in range(200, 230):
        f.admit([K(i)])
    assert len(f.counts) + len(f.old) <= 10
    assert f.admit([K(1)]) == []  # forgotten: counts again from one


def test_tinylfu_ages_counts():
    f = TinyLFUAdmission(threshold=3, width=64, sample=50)
    for _ in range(3):
        f.admit([K(1)])
    assert f.estimate(K(1)) >= 3
    for i in range(100):  # two agings
        f.admit([K(1000 + i)])
    assert f.estimate(K(1)) < 3


@pytest.mark.parametrize("kwargs, name", [
    ({"threshold": 0}, "threshold"), ({"threshold": 1.5}, "threshold"), ({"memory": -1}, "memory"),
])
def test_store_count_bad_settings(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        StoreCountAdmission(**kwargs)


@pytest.mark.parametrize("kwargs, name", [({"width": 0}, "width"), ({"sample": True}, "sample")])
def test_tinylfu_bad_settings(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        TinyLFUAdmission(**kwargs)
