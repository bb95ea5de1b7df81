"""Every error and warning autotune raises.

The tree::

    AutotuneError
    ├── ConfigurationError (also ValueError)   bad input: the message names the value, the rule, the fix
    ├── CandidateError                         one candidate could not be measured; the search goes on
    │   ├── TrialTimeout (also TimeoutError)   a batch or the whole trial ran past its limit
    │   ├── MemoryLimitExceeded (also MemoryError)  the main process and its workers outgrew the budget
    │   ├── WorkerFailed                       a worker process died (exit, signal) or could not start
    │   ├── CandidateInfeasible                its pre-transform cache cannot be built for this data
    │   │   └── ShapeChanged                   a later sample's shape differs from the probe samples'
    │   └── TrialPruned                        stopped early: clearly slower than the best so far
    ├── TuningFailed (also RuntimeError)       no candidate could be measured, for reasons not the user's
    └── ProfileStoreError                      the profile store could not be read or written

    AutotuneWarning (UserWarning)
    ├── ProfileStoreWarning                    an entry was ignored or could not be written
    └── StaleCacheWarning                      a pre-transform cache no longer matches its dataset

An exception raised by the user's own dataset or step is never wrapped: when it happens under every
candidate, :func:`autotune.tune_loader` raises that exception itself, with a note naming the candidate.
"""

from __future__ import annotations


class AutotuneError(Exception):
    """Base class of every error autotune raises."""


class ConfigurationError(AutotuneError, ValueError):
    """An argument or a dataset cannot be tuned as given."""


class CandidateError(AutotuneError):
    """One candidate configuration failed for a reason of its own; the search goes on."""


class TrialTimeout(CandidateError, TimeoutError):
    """A batch, or the whole trial, ran past its time limit."""


class MemoryLimitExceeded(CandidateError, MemoryError):
    """The main process and its workers together used more memory than the budget allows."""


class WorkerFailed(CandidateError):
    """A DataLoader worker process exited or was killed while the candidate ran."""


class CandidateInfeasible(CandidateError):
    """A candidate's pre-transform cache cannot be built: the dataset cannot be cached, a sample does
    not fit the layout planned from a few samples, or the cache outgrew its memory budget while being
    built. The message says which; the search records the candidate as failed and goes on."""


class ShapeChanged(CandidateInfeasible):
    """A field the probe samples showed with one shape has another shape in a later sample.

    ``fields`` are the indices of those fields in a sample. The build that meets it stores them ragged
    (each sample its own shape) and reads the samples again; it reaches the search only when that
    is not possible.
    """

    def __init__(self, message: str, fields: tuple[int, ...]) -> None:
        super().__init__(message)
        self.fields = fields


class TrialPruned(CandidateError):
    """A candidate was stopped early because it was clearly slower than the best so far."""


class TuningFailed(AutotuneError, RuntimeError):
    """No candidate could be measured, and the cause was not an error in the user's code."""


class ProfileStoreError(AutotuneError):
    """The profile store could not be read or written at all."""


class AutotuneWarning(UserWarning):
    """Base class of every warning autotune issues."""


class ProfileStoreWarning(AutotuneWarning):
    """A stored profile was ignored (corrupt, old schema) or a new one could not be written."""


class StaleCacheWarning(AutotuneWarning):
    """A pre-transform cache froze something that has changed since (a step's parameter, the data)."""
