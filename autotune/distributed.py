"""Tuning under ``torchrun``: every rank measures the same candidate at the same time.

# NOTE [ Cooperative tuning ]
# On a node with several ranks, every rank has its own DataLoader and all their workers share the
# node's CPUs, so one rank tuned alone picks too many workers. When a process group is initialised,
# ``tune_loader`` therefore tunes cooperatively, with torch.distributed and nothing home-made:
# - rank 0 alone drives the Optuna study; before each measurement it broadcasts the candidate, every
#   rank measures it at the same time (so contention for CPUs and memory is real), and the outcomes are
#   gathered and reduced: the slowest rank decides a step (lowest throughput, highest wait, largest
#   start-up), memory is the node's sum, and a candidate that fails on any rank fails for all;
# - at the end rank 0 broadcasts the result and every rank returns the same one;
# - the worker bound of the search space is per rank: usable CPUs / local world size;
# - all of this runs on a separate gloo group (CPU objects, any main backend: gloo or NCCL) created with
#   a finite timeout, so a rank that dies makes the others fail with TuningFailed instead of hanging.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .exceptions import CandidateError, TuningFailed
from .measure import Measurement, measure
from .space import Candidate

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0
"""What the control group's timeout is built from when the caller has no budget (the drop-in)."""

COLLECTIVE_MARGIN_S = 120.0
"""Added to the tuning budget for the control group's timeout: the longest a rank may wait for another."""


@dataclass
class DistContext:
    """This rank's place in the job, and the control group used to coordinate tuning."""

    rank: int
    world_size: int
    local_world_size: int
    group: Any

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj: Any = None) -> Any:
        box = [obj]
        try:
            dist.broadcast_object_list(box, src=0, group=self.group)
        except Exception as err:  # noqa: BLE001 - a dead or diverged rank, whatever the backend says
            raise TuningFailed(
                f"rank {self.rank}: the broadcast from rank 0 failed ({type(err).__name__}: {err});"
                " a rank died or left tuning early. Restart the job."
            ) from err
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except Exception as err:  # noqa: BLE001
            raise TuningFailed(
                f"rank {self.rank}: gathering the measurements failed ({type(err).__name__}: {err});"
                " a rank died or stopped answering. Restart the job."
            ) from err
        return out


def context(budget_s: float) -> DistContext | None:
    """The distributed context when a process group is initialised with more than one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.get_world_size()
    if world < 2:
        return None
    timeout = datetime.timedelta(seconds=budget_s + COLLECTIVE_MARGIN_S)
    rank = dist.get_rank()
    try:
        group = dist.new_group(backend="gloo", timeout=timeout)
        local = _local_world_size(rank, world, group)
    except Exception as err:  # noqa: BLE001 - a rank that never arrived, whatever the store says
        raise TuningFailed(
            f"rank {rank}: the {world} ranks could not set up cooperative tuning"
            f" ({type(err).__name__}: {err}); every rank must call tune_loader with the same"
            " arguments. Restart the job."
        ) from err
    return DistContext(rank=rank, world_size=world, local_world_size=local, group=group)


def _local_world_size(rank: int, world: int, group: Any) -> int:
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env and env.isdigit():
        return max(1, int(env))
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, os.uname().nodename, group=group)
    return max(1, hosts.count(os.uname().nodename))


@dataclass
class _Outcome:
    """One rank's result for one candidate; ``shared()`` is what the other ranks receive."""

    kind: str  # "ok" | "candidate" (the candidate failed) | "user" (the user's code raised)
    payload: Any  # the measurement as a dict, or the error described in one line
    error: BaseException | None = None

    def shared(self) -> tuple[str, Any]:
        return (self.kind, self.payload)


def _outcome(fn: Callable[[], Measurement]) -> _Outcome:
    try:
        return _Outcome("ok", fn().to_dict())
    except CandidateError as err:
        return _Outcome("candidate", f"{type(err).__name__}: {err}", err)
    except Exception as err:  # noqa: BLE001 - the user's error, kept for this rank, described for all
        return _Outcome("user", f"{type(err).__name__}: {err}", err)


def reduce_measurements(ms: list[Measurement]) -> Measurement:
    """The slowest rank decides a step; memory is what the node as a whole used."""
    slowest = min(ms, key=lambda m: m.samples_per_s)
    return Measurement(
        samples_per_s=slowest.samples_per_s,
        busy=min(m.busy for m in ms),
        wait_fraction=max(m.wait_fraction for m in ms),
        step_ms=max(m.step_ms for m in ms),
        wait_ms=max(m.wait_ms for m in ms),
        startup_s=max(m.startup_s for m in ms),
        startup_seen=all(m.startup_seen for m in ms),
        batches=slowest.batches,
        samples=slowest.samples,
        window_s=slowest.window_s,
        peak_memory_bytes=sum(m.peak_memory_bytes for m in ms),
        build_s=max(m.build_s for m in ms),
        cache_bytes=max(m.cache_bytes for m in ms),
        log_se=slowest.log_se,
    )


class Coordinator:
    """Rank 0's side: a drop-in for :func:`autotune.measure.measure` that measures on every rank."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx

    def __call__(self, dataset: Any, candidate: Candidate, **kwargs: Any) -> Measurement:
        limits = kwargs.get("limits")
        self.ctx.broadcast(("measure", candidate.to_dict(), limits))
        local = _outcome(lambda: measure(dataset, candidate, **kwargs))
        outcomes = self.ctx.gather(local.shared())
        if local.error is not None:
            raise local.error  # this rank's own exception, unchanged: the user's error stays theirs
        failed = [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
        if failed:
            rank, (_, text) = failed[0]
            raise CandidateError(f"failed on rank {rank}: {text}")
        return reduce_measurements([Measurement.from_dict(o[1]) for o in outcomes])

    def finish(self, payload: tuple[str, Any]) -> None:
        """Tell every rank the search is over: ("result", dict) or ("error", text)."""
        self.ctx.broadcast(("done", payload))


def follow(ctx: DistContext, dataset: Any, **kwargs: Any) -> dict[str, Any]:
    """A rank other than 0: measure what rank 0 asks for until it sends the result; return it."""
    user_error: BaseException | None = None
    while True:
        message = ctx.broadcast(None)
        if message[0] == "measure":
            _, cdict, limits = message
            candidate = Candidate.from_dict(cdict)

            def run(c: Candidate = candidate, lim: Any = limits) -> Measurement:
                return measure(dataset, c, limits=lim, **kwargs)

            local = _outcome(run)
            if local.kind == "user":
                user_error = local.error
            ctx.gather(local.shared())
            continue
        if message[0] == "done":
            kind, payload = message[1]
            if kind == "result":
                return dict(payload)
            if user_error is not None:
                raise user_error
            raise TuningFailed(f"rank 0 ended tuning without a result: {payload}")
        raise TuningFailed(f"rank {ctx.rank}: unexpected message from rank 0: {message[0]!r}")
