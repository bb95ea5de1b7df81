"""``autotune run train.py``: run an unmodified training script with its DataLoaders tuned.

# NOTE [ autotune run ]
# The script runs as ``python`` would run it, in this process (runpy: ``__name__ == "__main__"``,
# ``sys.argv`` as the script expects, its own folder first on ``sys.path``), with
# ``torch.utils.data.DataLoader`` (and ``torch.utils.data.dataloader.DataLoader``) standing for a
# subclass of the drop-in :class:`autotune.loader.DataLoader` whose explicit settings are starting
# points rather than fixed: ``num_workers``, ``prefetch_factor``, ``pin_memory`` and
# ``persistent_workers`` written in the script are measured first and searched around, while
# ``batch_size``, ``shuffle``, samplers and ``collate_fn`` stay the script's. Everything is put back
# when the script ends, however it ends.
# - What the script prints, raises and exits with is its own: its traceback is printed by
#   ``sys.excepthook`` without this module's and runpy's frames, an exception exits 1, a
#   ``SystemExit`` keeps its code. autotune writes only to stderr (the JSON only to a file).
# - Reporting listens to the drop-in (``loader.add_listener``). What a loader is needed for in the
#   report is copied when it is built, when it settles and when it is collected, so the run never
#   keeps a loader (and its workers) alive that the script has let go.
# - A library that rebuilds a loader it was handed (accelerate does, for the Hugging Face Trainer)
#   makes two loaders of one: the rebuilt one is reported under the first one's origin and settings.
# - ``--stop-when-tuned`` raises ``StopScript`` (a BaseException, so ``except Exception`` in the
#   script does not swallow it, while its ``finally`` blocks run) from the loader that settles last,
#   or from ``iter()`` of a loader that starts settled from a stored profile.
# - At the end every drop-in loader still alive is closed (workers gone, thread counts put back),
#   newest first, so the torch thread count returns to what the script had.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import os
import runpy
import statistics
import sys
import textwrap
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any, TextIO

import torch
import torch.utils.data as tud
import torch.utils.data.dataloader as tud_dataloader

from . import loader as dropin
from .report import TEXT_WIDTH
from .result import TuneResult, built_text
from .space import Candidate

EXIT_OK = 0
EXIT_FAILED = 1
"""What ``python`` exits with when the script raises."""
EXIT_INTERRUPTED = 130
"""128 + SIGINT, what a shell reports for a command stopped with Ctrl-C."""

JSON_SCHEMA = 1
"""Version of the ``--json`` document; raised when a field changes meaning."""

_OWN_FRAMES = (os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>")
"""Files whose frames lead into the script: left out of its traceback, as python shows none."""
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

_TUNED_ARGS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")
"""torch DataLoader arguments ``autotune run`` searches (the script's values are starting points)."""


class TargetError(Exception):
    """The script or module cannot be run as named (a usage error: exit 2)."""


class StopScript(BaseException):
    """Raised inside the script by ``--stop-when-tuned`` once every loader it iterates has settled.

    A BaseException, like KeyboardInterrupt, so that the script's ``except Exception`` does not
    swallow it; its ``finally`` blocks and context managers still run.
    """


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name (exactly one), and the arguments it gets."""

    script: str | None = None
    module: str | None = None
    args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.script is None) == (self.module is None):
            raise TargetError("give a script to run, or -m MODULE, not both and not neither")

    @property
    def name(self) -> str:
        return self.script if self.script is not None else f"-m {self.module}"


@dataclass
class LoaderRecord:
    """What the report says about one loader, copied from it while it is alive."""

    number: int
    origin: str
    called_from: str | None
    builder: str
    """The module whose code built the loader (``transformers.trainer``: the Trainer built it)."""
    script_settings: dict[str, Any]
    batch_size: int | None
    epoch_batches: int | None
    """``len(loader)``: batches per epoch (None for a stream without a length)."""
    rebuilt_at: str | None = None
    """Where a library rebuilt the loader the script's code made (reported under the first)."""
    replaced: bool = False
    """This loader was rebuilt by a library and never iterated: its rebuilt one is reported."""
    iterated: bool = False
    served_batches: int = 0
    settled: bool = False
    tuning: TuneResult | None = None
    settled_before: bool = False
    """The loader settled, and measured again after (its ``tuning`` is the settled choice)."""
    measuring_again: str | None = None
    """What it measured again then, for the report."""
    untuned: str | None = None
    """Why the loader served as torch serves and tuned nothing (``DataLoader.untuned``)."""

    def copy_state(self, loader: dropin.DataLoader) -> None:
        self.served_batches = loader.served_batches
        self.settled = loader.settled
        self.untuned = loader.untuned
        if loader.untuned is not None:
            return
        self.settled_before = loader._tuning.settled_before()
        self.measuring_again = loader._tuning.measuring_again()
        # Measuring again, the settled choice stands (and is the stored profile), not the new
        # measurements' provisional pick.
        self.tuning = loader._tuning.result if self.settled_before else loader.tuning

    @property
    def tunable(self) -> bool:
        """Whether one epoch is long enough to tune (a stream without a length is assumed to be)."""
        return self.epoch_batches is None or self.epoch_batches >= dropin.MIN_TUNE_BATCHES

    @property
    def status(self) -> str:
        """``untuned``, ``from-profile``, ``tuned``, ``exploring``, ``too-short``, ``not-iterated`` or
        ``unmeasured``."""
        if self.untuned is not None:
            return "untuned"
        if self.tuning is not None and self.tuning.from_cache:
            return "from-profile"
        if self.served_batches == 0:
            return "not-iterated"
        if self.served_batches < dropin.MIN_TUNE_BATCHES:
            return "too-short"
        if self.tuning is None or not self.tuning.trials:
            return "unmeasured"
        return "tuned" if self.settled or self.settled_before else "exploring"


@dataclass
class RunOutcome:
    """How the script ended and what autotune saw of its loaders."""

    target: Target
    exit_code: int = EXIT_OK
    ended: str = "finished"
    """``finished``, ``exited`` (SystemExit), ``raised``, ``interrupted`` or ``stopped-when-tuned``."""
    error: str | None = None
    seconds: float = 0.0
    loaders: list[LoaderRecord] = field(default_factory=list)

    @property
    def reported(self) -> list[LoaderRecord]:
        return [r for r in self.loaders if not r.replaced]


class _Session(dropin.Listener):
    """Hears of every drop-in loader the script builds, and stops the script when asked to."""

    def __init__(self, *, main_file: str | None, stop_when_tuned: bool, progress: TextIO | None,
                 epochs: int | None = None) -> None:
        self.main_file = os.path.abspath(main_file) if main_file else None
        self.epochs = epochs
        """The script's training length, where the command was told it."""
        self.stop_when_tuned = stop_when_tuned
        self.progress = progress
        self.records: list[LoaderRecord] = []
        self._by_id: dict[int, tuple[weakref.ref[dropin.DataLoader], LoaderRecord]] = {}

    # -- the listener ------------------------------------------------------------------------------

    def built(self, loader: dropin.DataLoader) -> None:
        builder, called_from, parent = self._look_up_the_stack(loader)
        record = LoaderRecord(
            number=sum(not r.replaced for r in self.records) + 1, origin=_shown_origin(loader.origin),
            called_from=called_from, builder=builder, script_settings=dict(loader.script_settings),
            batch_size=loader.batch_size, epoch_batches=_length(loader),
        )
        if parent is not None:
            parent.replaced = True
            record.rebuilt_at, record.origin = record.origin, parent.origin
            record.called_from, record.builder = parent.called_from, parent.builder
            record.script_settings, record.batch_size = parent.script_settings, parent.batch_size
            record.number = parent.number
        record.copy_state(loader)
        self.records.append(record)
        key = id(loader)

        def forget(_: object) -> None:
            self._by_id.pop(key, None)

        self._by_id[key] = (weakref.ref(loader, forget), record)
        if record.status == "from-profile" and record.tuning is not None:
            self._say(f"the DataLoader at {record.origin} starts at its stored profile"
                      f" ({_label(record.tuning.candidate)})")

    def settled(self, loader: dropin.DataLoader) -> None:
        record = self._record(loader)
        if record is None:
            return  # settled from a profile inside its constructor: built() follows
        record.copy_state(loader)
        if record.status == "tuned" and record.tuning is not None:
            result = record.tuning
            speed = (f", {result.speedup_text()} {result.baseline_text()}"
                     if result.speedup is not None and not result.kept_baseline else
                     ", the script's own settings (nothing beat them with confidence)")
            self._say(f"the DataLoader at {record.origin} settled on {_label(result.candidate)}{speed}")
        self._maybe_stop()

    # -- from the stand-in loader ------------------------------------------------------------------

    def iterating(self, loader: dropin.DataLoader) -> None:
        record = self._record(loader)
        if record is None:
            return
        record.iterated = True
        if loader.settled:
            self._maybe_stop()

    def collected(self, loader: dropin.DataLoader) -> None:
        record = self._record(loader)
        if record is not None:
            record.copy_state(loader)

    # -- the end -----------------------------------------------------------------------------------

    def live_loaders(self) -> list[tuple[dropin.DataLoader, LoaderRecord]]:
        out = []
        for ref, record in list(self._by_id.values()):
            loader = ref()
            if loader is not None:
                out.append((loader, record))
        return out

    def close_all(self) -> None:
        """End each live loader's finished epoch, copy what it knows, then close it: newest first,
        so the torch thread counts unwind to the script's."""
        self.stop_when_tuned = False  # the script has ended: nothing is left to stop
        order = {id(record): i for i, record in enumerate(self.records)}
        for loader, record in sorted(self.live_loaders(), key=lambda lr: -order[id(lr[1])]):
            with contextlib.suppress(Exception):
                loader._finish_epoch()  # a trainer that stopped at len(loader) never ended it
            record.copy_state(loader)
            with contextlib.suppress(Exception):
                loader.close()

    # -- helpers -----------------------------------------------------------------------------------

    def _record(self, loader: dropin.DataLoader) -> LoaderRecord | None:
        entry = self._by_id.get(id(loader))
        return entry[1] if entry is not None and entry[0]() is loader else None

    def _say(self, line: str) -> None:
        if self.progress is not None:
            print(f"autotune: {line}", file=self.progress, flush=True)

    def _maybe_stop(self) -> None:
        if not self.stop_when_tuned:
            return
        live = {id(record): loader for loader, record in self.live_loaders()}
        iterated = [r for r in self.records if r.iterated and not r.replaced and r.tunable]
        if not iterated:
            return
        for r in iterated:
            loader = live.get(id(r))
            if not (loader.settled if loader is not None else r.settled):
                return
        for loader, record in self.live_loaders():
            record.copy_state(loader)
        raise StopScript("every DataLoader the script iterates is tuned (--stop-when-tuned)")

    def _look_up_the_stack(self, loader: dropin.DataLoader) -> tuple[str, str | None, LoaderRecord | None]:
        """The module that built ``loader``, the script's line the build came from, and the loader a
        library rebuilt into this one (see NOTE [ autotune run ])."""
        builder = "?"
        called_from: str | None = None
        parent: LoaderRecord | None = None
        frame: FrameType | None = inspect.currentframe()
        while frame is not None:
            path = os.path.abspath(frame.f_code.co_filename)
            ours = path.startswith((_PACKAGE_DIR, _TORCH_DIR)) or "<frozen" in path
            if not ours and builder == "?":
                builder = str(frame.f_globals.get("__name__", "?"))
            if self.main_file is not None and path == self.main_file:
                called_from = f"{_shown_path(path)}:{frame.f_lineno}"
                break
            if not ours and parent is None:
                parent = self._rebuilt_from(frame, loader)
            frame = frame.f_back
        del frame
        return builder, called_from, parent

    def _rebuilt_from(self, frame: FrameType, loader: dropin.DataLoader) -> LoaderRecord | None:
        """A loader of the same dataset, never iterated, held by a library frame building ``loader``."""
        for value in frame.f_locals.values():
            if isinstance(value, dropin.DataLoader) and value is not loader:
                record = self._record(value)
                if (record is not None and not record.replaced and value.served_batches == 0
                        and value.dataset is loader.dataset):
                    return record
        return None


def _label(c: Any) -> str:
    """A candidate's label without its batch size, which is the script's and never searched."""
    return c.label().split(" ", 1)[1] if c.label().startswith("bs=") else c.label()


def _length(loader: Any) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None


def _shown_path(path: str) -> str:
    """``path`` relative to the current folder, an installed package's file from its package
    (``transformers/trainer.py``), anything else absolute."""
    path = os.path.abspath(path)
    rel = os.path.relpath(path)
    if not rel.startswith(".."):
        return rel
    parts = Path(path).parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return path


def _shown_origin(origin: str) -> str:
    """A loader's ``file:line`` with the file as :func:`_shown_path` shows it."""
    path, sep, line = origin.rpartition(":")
    return f"{_shown_path(path)}:{line}" if sep and path else origin


class _StandInMeta(type):
    """The stand-in's metaclass: ``isinstance(x, torch.utils.data.DataLoader)`` keeps meaning any
    torch DataLoader while the name stands for the stand-in (the check asks torch's class)."""

    original: type = tud.DataLoader

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls.__dict__.get("_is_stand_in"):
            return isinstance(obj, cls.original)
        return type.__instancecheck__(cls, obj)

    def __subclasscheck__(cls, sub: Any) -> bool:
        if cls.__dict__.get("_is_stand_in"):
            return issubclass(sub, cls.original)
        return type.__subclasscheck__(cls, sub)


def _stand_in(session: _Session) -> type[dropin.DataLoader]:
    """The class ``torch.utils.data.DataLoader`` stands for while the script runs.

    Only the loaders built by calling it are tuned. A class that subclasses it (the script's own
    loader class, torchdata's StatefulDataLoader) gets torch's DataLoader as its base instead, since
    it may replace the iteration the drop-in tunes; ``DataLoader[T]`` is torch's generic alias.
    """
    original = tud.DataLoader

    class DataLoader(dropin.DataLoader, metaclass=_StandInMeta):
        __doc__ = dropin.DataLoader.__doc__
        explicit_settings_are_fixed = False
        default_epochs = session.epochs or dropin.DEFAULT_EPOCHS
        _is_stand_in = True

        def __class_getitem__(cls, item: Any) -> Any:
            return original[item]

        def __init_subclass__(cls, **kwargs: Any) -> None:
            super().__init_subclass__(**kwargs)
            cls.__bases__ = tuple(original if b is DataLoader else b for b in cls.__bases__)

        def __iter__(self) -> Any:
            session.iterating(self)
            return super().__iter__()

        def __del__(self) -> None:
            with contextlib.suppress(Exception):
                session.collected(self)

    return DataLoader


@contextlib.contextmanager
def _patched(replacement: type[dropin.DataLoader]) -> Iterator[None]:
    """``torch.utils.data.DataLoader`` is ``replacement`` inside the block, and torch's after it."""
    original = tud.DataLoader
    tud.DataLoader = replacement  # type: ignore[misc]
    tud_dataloader.DataLoader = replacement  # type: ignore[misc]
    try:
        yield
    finally:
        tud.DataLoader = original  # type: ignore[misc]
        tud_dataloader.DataLoader = original  # type: ignore[misc]


@contextlib.contextmanager
def _as_main(argv: list[str], path0: str) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python`` sets them for the script; put back afterwards."""
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    sys.argv[:] = argv
    if sys.path:
        sys.path[0] = path0
    else:
        sys.path.append(path0)
    try:
        yield
    finally:
        sys.argv[:] = saved_argv
        sys.path[:] = saved_path


def check_target(target: Target) -> None:
    """Raise :class:`TargetError` when the script does not exist (a module is checked when run,
    since finding it imports its parent packages, which are the user's code)."""
    if target.script is None:
        return
    path = Path(target.script)
    if path.is_dir():
        if not (path / "__main__.py").is_file():
            raise TargetError(f"{target.script!r} is a folder without a __main__.py; give the script to run")
    elif not path.is_file():
        raise TargetError(f"cannot open {target.script!r}: no such file; check the path")


def _module_file(name: str) -> str:
    """The file ``python -m name`` would run; :class:`TargetError` when there is none."""
    try:
        spec = importlib.util.find_spec(name)
    except ModuleNotFoundError as err:
        if err.name and (name == err.name or name.startswith(err.name + ".")):
            raise TargetError(
                f"no module named {err.name!r}; check the name, and run from the folder that holds it"
                " or install it"
            ) from None
        raise
    if spec is None:
        raise TargetError(f"no module named {name!r}; check the name, and run from the folder that"
                          " holds it or install it")
    if spec.submodule_search_locations is not None:  # a package: python -m runs its __main__
        main = importlib.util.find_spec(f"{name}.__main__")
        if main is None or main.origin is None:
            raise TargetError(f"{name!r} is a package without a __main__ module; name the module to run")
        return main.origin
    if spec.origin is None:
        raise TargetError(f"module {name!r} has no file to run")
    return spec.origin


def _user_traceback(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` without the leading frames of this module and runpy, as python would show it."""
    while tb is not None and (tb.tb_frame.f_code.co_filename in _OWN_FRAMES
                              or os.path.abspath(tb.tb_frame.f_code.co_filename) in _OWN_FRAMES):
        tb = tb.tb_next
    return tb


def run(target: Target, *, json_path: str | None = None, stop_when_tuned: bool = False,
        quiet: bool = False, stderr: TextIO | None = None, epochs: int | None = None) -> RunOutcome:
    """Run ``target`` with its DataLoaders tuned (see NOTE [ autotune run ]); report on ``stderr``.

    Returns the outcome, whose ``exit_code`` is what ``python`` would have exited with (130 after
    Ctrl-C, 0 after ``--stop-when-tuned``). Raises :class:`TargetError` for a script that does not
    exist or a module that cannot be found, before anything runs.
    """
    err_out = stderr if stderr is not None else sys.stderr
    check_target(target)
    outcome = RunOutcome(target)
    session = _Session(main_file=None, stop_when_tuned=stop_when_tuned,
                       progress=None if quiet else err_out, epochs=epochs)
    started = time.perf_counter()
    dropin.add_listener(session)
    try:
        with _patched(_stand_in(session)):
            try:
                _execute(target, session)
            except TargetError:
                raise
            except StopScript as stop:
                outcome.ended, outcome.error = "stopped-when-tuned", str(stop)
            except SystemExit as exit_:
                outcome.ended = "exited"
                outcome.exit_code = _exit_code(exit_.code, err_out)
            except KeyboardInterrupt as err:
                _print_traceback(err, err_out)
                outcome.ended, outcome.exit_code, outcome.error = "interrupted", EXIT_INTERRUPTED, "Ctrl-C"
            except BaseException as err:  # noqa: BLE001 - the script's own error: shown, then its exit code
                _print_traceback(err, err_out)
                outcome.ended, outcome.exit_code = "raised", EXIT_FAILED
                outcome.error = f"{type(err).__name__}: {err}"
    finally:
        dropin.remove_listener(session)
        session.close_all()
        outcome.seconds = time.perf_counter() - started
        outcome.loaders = session.records
    print(report_text(outcome), file=err_out, flush=True)
    if json_path is not None:
        write_json(outcome, json_path)
        print(f"autotune: the report is in {json_path}", file=err_out, flush=True)
    return outcome


def _execute(target: Target, session: _Session) -> None:
    if target.script is not None:
        script = target.script
        folder = os.path.dirname(os.path.abspath(script))
        main_file = os.path.join(script, "__main__.py") if os.path.isdir(script) else script
        session.main_file = os.path.abspath(main_file)
        with _as_main([script, *target.args], os.path.abspath(script) if os.path.isdir(script) else folder):
            runpy.run_path(script, run_name="__main__")
        return
    assert target.module is not None
    with _as_main([target.module, *target.args], os.getcwd()):
        session.main_file = os.path.abspath(_module_file(target.module))
        runpy.run_module(target.module, run_name="__main__", alter_sys=True)


def _exit_code(code: Any, out: TextIO) -> int:
    """What ``python`` exits with for ``sys.exit(code)`` (a message is printed, then 1)."""
    if code is None:
        return EXIT_OK
    if isinstance(code, int) and not isinstance(code, bool):
        return code
    print(code, file=out, flush=True)
    return EXIT_FAILED


def _print_traceback(err: BaseException, out: TextIO) -> None:
    """The script's traceback as python prints it (its ``sys.excepthook``, which may be its own)."""
    tb = _user_traceback(err.__traceback__)
    err.with_traceback(tb)  # the hook shows the exception's own traceback when it has one
    out.flush()
    if out is sys.stderr:
        sys.excepthook(type(err), err, tb)
    else:
        import traceback

        traceback.print_exception(type(err), err, tb, file=out)


# --------------------------------------------------------------------------------------------------
# The report


def _settings_text(settings: dict[str, Any], batch_size: int | None) -> str:
    parts = [f"batch_size={batch_size!r}"]
    parts += [f"{k}={settings[k]!r}" for k in _TUNED_ARGS if k in settings]
    if not any(k in settings for k in _TUNED_ARGS):
        parts.append("and PyTorch's defaults (num_workers=0)")
    return ", ".join(parts)


def _plain(result: TuneResult) -> TuneResult:
    """``result`` as torch's DataLoader (and so a Trainer) can take it: when thread workers or a
    cache won, the best measured configuration with neither, or PyTorch's defaults."""
    c = result.candidate
    if not c.threaded and c.pretransform == "none":
        return result
    ok = [t for t in result.trials if t.state == "complete" and t.score is not None
          and not t.candidate.threaded and t.candidate.pretransform == "none"]
    best = max(ok, key=lambda t: t.score or 0.0).candidate if ok else Candidate(c.batch_size)
    rates = [t.measurement.samples_per_s for t in ok if t.candidate == best and t.measurement]
    return replace(result, loader_kwargs=best.loader_kwargs(), pretransform="none",
                   torch_threads=best.torch_threads,
                   samples_per_s=statistics.median(rates) if rates else 0.0)


def _plain_kwargs(result: TuneResult) -> dict[str, Any]:
    """The best settings for torch's DataLoader, as its keyword arguments (see :func:`_plain`)."""
    args = _plain(result).training_args()
    out = {k.removeprefix("dataloader_"): v for k, v in args.items()}
    if not out["num_workers"]:
        out = {"num_workers": 0, "pin_memory": out["pin_memory"]}
    return out


def _paste(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "batch_size")


def _loader_section(record: LoaderRecord) -> list[str]:
    where = f"DataLoader {record.number}, built at {record.origin}"
    if record.called_from and record.called_from != record.origin:
        where += f" (called from {record.called_from})"
    lines = [where]
    if record.rebuilt_at:
        lines.append(f"  rebuilt at {record.rebuilt_at} when it was handed on; the rebuilt loader served"
                     " the batches")
    lines.append(f"  the script's settings: {_settings_text(record.script_settings, record.batch_size)}")
    status = record.status
    if status == "untuned":
        lines += textwrap.wrap(f"  served as torch serves it, untuned: {record.untuned}", width=TEXT_WIDTH,
                               subsequent_indent="    ")
        return lines
    if status == "not-iterated":
        lines.append("  never iterated: nothing to tune")
        return lines
    if status == "too-short":
        lines.append(
            f"  iterated too little to tune: {record.served_batches} batch"
            f"{'es' if record.served_batches != 1 else ''} served, {dropin.MIN_TUNE_BATCHES} needed;"
            " nothing is recommended for it"
        )
        return lines
    if status == "unmeasured":
        lines.append(f"  {record.served_batches} batches served, but no configuration could be measured;"
                     " nothing is recommended for it")
        return lines
    result = record.tuning
    assert result is not None
    c = result.candidate
    head = {"from-profile": "best (stored profile)", "tuned": "best found", "exploring":
            "best so far (provisional: the script ended while it was still exploring)"}[status]
    kept = " (the script's own settings: nothing beat them with confidence)" if result.kept_baseline else ""
    lines.append(f"  {head}: {_label(c)}{kept}")
    if record.settled_before and record.measuring_again is not None:
        lines += textwrap.wrap(f"  measured again when the script ended: {record.measuring_again};"
                               " the choice above stands", width=TEXT_WIDTH, subsequent_indent="    ")
    against = result.baseline_text()
    if result.speedup is not None and result.baseline_samples_per_s is not None:
        lines += textwrap.wrap(
            f"  speed-up: {result.speedup_text()} {against} over {result.epochs} epochs, start-up"
            f" included{built_text(result)}; both measured side by side"
            f"{' when the profile was stored' if status == 'from-profile' else ''}",
            width=TEXT_WIDTH, subsequent_indent=" " * 12)
        if result.throughput_speedup is not None:
            lines.append(f"            {result.throughput_speedup:.2f}x in steady-state samples/s"
                         f" ({result.samples_per_s:,.0f} vs {result.baseline_samples_per_s:,.0f})")
    if result.decision and status != "from-profile":
        lines += textwrap.wrap(f"  decision: {result.decision}", width=TEXT_WIDTH,
                               subsequent_indent=" " * 12)
    if result.kept_baseline:
        lines.append("  nothing to change in the script")
    else:
        lines += _paste_lines(record, result)
    if status == "exploring":
        lines.append("  not stored as a profile: the next run explores again (train longer to settle)")
    elif status == "tuned" and result.key:
        lines.append(f"  stored as profile {result.key}: the next `autotune run` starts there")
    return lines


def _paste_lines(record: LoaderRecord, result: TuneResult) -> list[str]:
    c = result.candidate
    plain = _plain(result)
    threads = plain.torch_threads
    if record.builder.startswith("transformers."):
        args = ", ".join(f"{k}={v!r}" for k, v in plain.training_args().items())
        out = ["  the Trainer builds this loader; paste into TrainingArguments(...):", f"      {args}"]
        if plain is not result:
            out.append(f"  (the best measured without thread workers or a cache, which a Trainer's plain"
                       f" DataLoader cannot use: {plain.samples_per_s:,.0f} samples/s)")
    elif plain is result:
        out = [f"  paste into the DataLoader(...) at {record.origin}, keeping its other arguments:",
               f"      {_paste(_plain_kwargs(result))}"]
    else:
        why = []
        if c.threaded:
            why.append(f"{c.num_workers} thread worker{'s' if c.num_workers != 1 else ''}")
        if c.pretransform != "none":
            why.append(f"a {c.pretransform!r} pre-transform cache")
        out = [f"  the best uses {' and '.join(why)}, which torch's DataLoader cannot express;"]
        if c.threaded and c.pretransform == "none":
            kw = {k: v for k, v in result.loader_kwargs.items() if k not in ("num_workers", "batch_size")}
            out += ["  use autotune's thread loader there (from autotune import ThreadDataLoader):",
                    f"      ThreadDataLoader(dataset, batch_size={record.batch_size!r}, {_paste(kw)})"]
            if c.torch_threads is not None:
                out.append(f"      torch.set_num_threads({c.torch_threads})")
        first = "or" if c.threaded and c.pretransform == "none" else "use"
        out += [f"  {first} `from autotune import DataLoader` there, these four settings left out: it"
                " starts at this profile.",
                f"  With torch's DataLoader, the best measured ({plain.samples_per_s:,.0f} samples/s) is:",
                f"      {_paste(_plain_kwargs(result))}"]
    if threads is not None:  # the main process's thread count it was measured with
        out.append(f"      torch.set_num_threads({threads})")
    return out


def report_text(outcome: RunOutcome) -> str:
    """The end-of-run report on stderr: one section per loader (see :func:`run`)."""
    ended = {
        "finished": f"finished (exit code {outcome.exit_code})",
        "exited": f"exited with code {outcome.exit_code}",
        "raised": f"raised {outcome.error} (exit code {outcome.exit_code})",
        "interrupted": f"was interrupted (exit code {outcome.exit_code})",
        "stopped-when-tuned": "was stopped: every DataLoader it iterates is tuned (--stop-when-tuned)",
    }[outcome.ended]
    loaders = outcome.reported
    rule = "-" * min(TEXT_WIDTH, 72)
    lines = ["", rule, f"autotune: {outcome.target.name} {ended} after {outcome.seconds:.1f} s."]
    if not loaders:
        before = " before building one" if outcome.ended in ("raised", "interrupted", "exited") else ""
        lines.append(f"It built no torch DataLoader{before}, so there was nothing to tune.")
        return "\n".join([*lines, rule])
    lines.append(f"It built {len(loaders)} DataLoader{'s' if len(loaders) != 1 else ''}"
                 " (batch_size, shuffle, samplers and collate_fn are the script's and were kept):")
    for record in loaders:
        lines += ["", *_loader_section(record)]
    return "\n".join([*lines, rule])


def to_dict(outcome: RunOutcome) -> dict[str, Any]:
    """The report as one JSON-able document (``--json PATH``)."""
    loaders = []
    for r in outcome.reported:
        entry: dict[str, Any] = {
            "number": r.number, "origin": r.origin, "called_from": r.called_from, "builder": r.builder,
            "rebuilt_at": r.rebuilt_at, "script_settings": r.script_settings, "batch_size": r.batch_size,
            "epoch_batches": r.epoch_batches, "served_batches": r.served_batches,
            "min_tune_batches": dropin.MIN_TUNE_BATCHES, "status": r.status, "settled": r.settled,
            "measuring_again": r.measuring_again,
        }
        measured = r.status in ("tuned", "exploring", "from-profile") and r.tuning is not None
        if measured and r.tuning is not None:
            entry.update(
                best=r.tuning.loader_kwargs, best_label=_label(r.tuning.candidate),
                loader_class=r.tuning.candidate.loader_class, pretransform=r.tuning.pretransform,
                torch_threads=r.tuning.torch_threads, plain_kwargs=_plain_kwargs(r.tuning),
                plain_torch_threads=_plain(r.tuning).torch_threads,
                plain_samples_per_s=_plain(r.tuning).samples_per_s,
                training_args=_plain(r.tuning).training_args(), samples_per_s=r.tuning.samples_per_s,
                baseline_samples_per_s=r.tuning.baseline_samples_per_s,
                throughput_speedup=r.tuning.throughput_speedup, speedup=r.tuning.speedup,
                speedup_low=r.tuning.speedup_low, speedup_high=r.tuning.speedup_high,
                confidence=r.tuning.confidence, kept_baseline=r.tuning.kept_baseline,
                baseline_kwargs=r.tuning.baseline_kwargs, decision=r.tuning.decision,
                profile_key=r.tuning.key, from_cache=r.tuning.from_cache,
                tuning=r.tuning.to_dict(),
            )
        loaders.append(entry)
    return {
        "schema": JSON_SCHEMA, "script": outcome.target.script, "module": outcome.target.module,
        "args": list(outcome.target.args), "ended": outcome.ended, "exit_code": outcome.exit_code,
        "error": outcome.error, "seconds": outcome.seconds, "loaders": loaders,
    }


def write_json(outcome: RunOutcome, path: str) -> None:
    Path(path).write_text(json.dumps(to_dict(outcome), indent=2, default=str) + "\n", encoding="utf-8")
