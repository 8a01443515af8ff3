"""The expert LRU with read reservations: entries plus reads in flight never exceed the budget."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deltafind.store.cache import ByteLRU

ops = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.integers(0, 9), st.integers(0, 120)),
        st.tuples(st.just("reserve"), st.integers(0, 0), st.integers(0, 80)),
        st.tuples(
            st.just("land"), st.integers(0, 9), st.integers(0, 0)
        ),  # the oldest reservation arrives as an entry
        st.tuples(st.just("get"), st.integers(0, 9), st.integers(0, 0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(budget=st.one_of(st.none(), st.integers(0, 300)), steps=ops)
def test_entries_plus_reservations_stay_within_budget(budget, steps) -> None:
    cache: ByteLRU[int, int] = ByteLRU(budget)
    in_flight: list[int] = []
    for op, key, n in steps:
        if op == "put":
            cache.put(key, key, n)
        elif op == "reserve":
            cache.reserve(n)
            in_flight.append(n)
        elif op == "land" and in_flight:
            size = in_flight.pop(0)
            cache.unreserve(size)
            cache.put(key, key, size)
        else:
            cache.get(key)
        assert cache.used_bytes == sum(size for _, size in cache._items.values())
        assert cache.reserved_bytes == sum(in_flight)
        if budget is not None:
            # nothing is kept while reads in flight already fill the budget
            assert len(cache) == 0 or cache.used_bytes + cache.reserved_bytes <= budget
