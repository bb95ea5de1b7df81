"""autotune: find the fastest PyTorch DataLoader configuration for this machine, by measuring it."""

from .api import DEFAULT_BUDGET_S, DEFAULT_EPOCHS, TuneResult, tune_loader
from .exceptions import (
    AutotuneError,
    AutotuneWarning,
    CandidateError,
    CandidateInfeasible,
    ConfigurationError,
    MemoryLimitExceeded,
    ProfileStoreError,
    ProfileStoreWarning,
    TrialPruned,
    TrialTimeout,
    TuningFailed,
    WorkerFailed,
)
from .machine import MachineInfo, detect_machine
from .measure import MeasureLimits, Measurement, measure
from .space import Candidate, SearchSpace
from .study import TrialRecord

__version__ = "0.1.0"

__all__ = [
    "AutotuneError",
    "AutotuneWarning",
    "Candidate",
    "CandidateError",
    "CandidateInfeasible",
    "ConfigurationError",
    "DEFAULT_BUDGET_S",
    "DEFAULT_EPOCHS",
    "MachineInfo",
    "MeasureLimits",
    "Measurement",
    "MemoryLimitExceeded",
    "ProfileStoreError",
    "ProfileStoreWarning",
    "SearchSpace",
    "TrialPruned",
    "TrialRecord",
    "TrialTimeout",
    "TuneResult",
    "TuningFailed",
    "WorkerFailed",
    "__version__",
    "detect_machine",
    "measure",
    "tune_loader",
]
