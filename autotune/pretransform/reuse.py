"""Plans and builds kept per dataset object, weakly, so that a second loader reuses the first's cache.

Both are keyed by the dataset's ``id`` and dropped when the dataset is collected; a dataset that
cannot be weakly referenced gets a new plan and a new build each time. A stored plan is made again
when what it froze has changed (NOTE [ Fresh caches ]).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .build import Prepared
from .split import CachePlan, make_cache_plan, stale_reason

BuildKey = tuple[int, str, str]
"""(id of the dataset, strategy, device the cache lives on)."""

_lock = threading.Lock()
_plans: dict[int, tuple[weakref.ref[Any], CachePlan]] = {}
_builds: dict[BuildKey, tuple[weakref.ref[Any], CachePlan, Prepared]] = {}


def _forget(key_id: int, lock: Any = _lock, plans: Any = _plans, builds: Any = _builds) -> None:
    # The stores are bound as defaults: at interpreter exit, module globals may already be None.
    with lock:
        plans.pop(key_id, None)
        for key in [k for k in builds if k[0] == key_id]:
            del builds[key]


def _weak(dataset: Any) -> weakref.ref[Any] | None:
    """A weak reference that drops the dataset's plans and caches when it is collected."""
    key_id = id(dataset)
    forget = _forget
    try:
        return weakref.ref(dataset, lambda _: forget(key_id))
    except TypeError:
        return None  # not weakly referenceable: plans and builds are then not reused


def plan_for(dataset: Any) -> tuple[CachePlan, str | None]:
    """The dataset's plan, made again when what the stored one froze changed (and why it did)."""
    with _lock:
        entry = _plans.get(id(dataset))
    stale = None
    if entry is not None and entry[0]() is dataset:
        stale = stale_reason(dataset, entry[1]) if entry[1].reason is None else None
        if stale is None:
            return entry[1], None
    plan = make_cache_plan(dataset)
    ref = _weak(dataset) if plan.reason is None else None
    if ref is not None:
        with _lock:
            _plans[id(dataset)] = (ref, plan)
    return plan, stale


def stored_build(dataset: Any, key: BuildKey) -> tuple[CachePlan, Prepared] | None:
    """The build stored under ``key`` for this very dataset object (its plan, and the build), or None."""
    with _lock:
        entry = _builds.get(key)
    if entry is None or entry[0]() is not dataset:
        return None
    return entry[1], entry[2]


def keep_build(dataset: Any, key: BuildKey, plan: CachePlan, prepared: Prepared) -> None:
    """Store ``prepared`` for reuse while ``dataset`` lives."""
    ref = _weak(dataset)
    if ref is not None:
        with _lock:
            _builds[key] = (ref, plan, prepared)


def clear_builds() -> None:
    """Drop every stored cache and plan (their memory is freed once no loader uses them)."""
    with _lock:
        _plans.clear()
        _builds.clear()
