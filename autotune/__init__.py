"""autotune: find the fastest PyTorch DataLoader configuration for this machine, by measuring it."""

import importlib.metadata

from .api import tune_loader
from .decide import TrialRecord
from .exceptions import (
    AutotuneError,
    AutotuneWarning,
    CandidateError,
    CandidateInfeasible,
    ConfigurationError,
    MemoryLimitExceeded,
    ProfileStoreError,
    ProfileStoreWarning,
    ShapeChanged,
    StaleCacheWarning,
    TrialPruned,
    TrialTimeout,
    TuningFailed,
    WorkerFailed,
)
from .loader import DataLoader
from .machine import detect_machine
from .measure import Measurement, measure
from .profiles import open_store
from .result import DEFAULT_BUDGET_S, DEFAULT_EPOCHS, TuneResult
from .space import Candidate
from .supervise import MeasureLimits
from .threads import ThreadDataLoader

_DISTRIBUTION = "dataloader-autotune"
"""The name this package is installed under (the import name is ``autotune``)."""

try:
    __version__ = importlib.metadata.version(_DISTRIBUTION)
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a tree never installed
    __version__ = "0+unknown"

__all__ = [
    "AutotuneError",
    "AutotuneWarning",
    "Candidate",
    "CandidateError",
    "CandidateInfeasible",
    "ConfigurationError",
    "DEFAULT_BUDGET_S",
    "DEFAULT_EPOCHS",
    "DataLoader",
    "MeasureLimits",
    "Measurement",
    "MemoryLimitExceeded",
    "ProfileStoreError",
    "ProfileStoreWarning",
    "ShapeChanged",
    "StaleCacheWarning",
    "ThreadDataLoader",
    "TrialPruned",
    "TrialRecord",
    "TrialTimeout",
    "TuneResult",
    "TuningFailed",
    "WorkerFailed",
    "__version__",
    "detect_machine",
    "measure",
    "open_store",
    "tune_loader",
]
