"""The package's front door: ``__all__`` lists every public name, sorted, and nothing else."""

from __future__ import annotations

import importlib.metadata
import types

import autotune


def test_all_is_sorted_and_complete() -> None:
    public = {
        name for name, value in vars(autotune).items()
        if not name.startswith("_") and not isinstance(value, types.ModuleType)
    }
    assert list(autotune.__all__) == sorted(autotune.__all__)
    assert set(autotune.__all__) - {"__version__"} == public


def test_every_exception_is_exported_and_in_the_tree() -> None:
    from autotune import exceptions

    classes = {
        n for n, v in vars(exceptions).items()
        if isinstance(v, type) and v.__module__ == exceptions.__name__
    }
    assert classes <= set(autotune.__all__)
    # The tree drawn in the module docstring names every class.
    assert all(name in (exceptions.__doc__ or "") for name in classes)


def test_the_version_is_the_installed_distribution_s() -> None:
    # Read from the installed metadata, so it cannot drift from pyproject.toml's version.
    assert autotune.__version__ == importlib.metadata.version("dataloader-autotune")


def test_only_what_a_user_calls_is_exported() -> None:
    # The profile store the command manages is public; the search space and machine facts, which no
    # public call takes, are not.
    assert "open_store" in autotune.__all__
    assert not {"SearchSpace", "MachineInfo"} & set(autotune.__all__)
