"""The ``autotune`` command: a thin shell over :func:`autotune.tune_loader` and the profile store.

::

    autotune tune [--dataset SPEC] [--batch-size N|auto] [--budget SECONDS] [--json] [--plot FILE] ...
    autotune profiles list | show KEY | clear [KEY | --all]
    autotune cache list | clear
    autotune run [--json PATH] [--stop-when-tuned] SCRIPT [ARGS...] | -m MODULE [-- ARGS...]

Exit status: 0 success, 1 tuning failed (or the user's dataset or step raised), 2 usage error (a bad
flag or value, or a ConfigurationError), 130 interrupted. ``autotune run`` exits with the script's own
code (1 when it raised), or 2 when the script or module cannot be found.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
import textwrap
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
"""128 + SIGINT, what a shell reports for a command stopped with Ctrl-C."""

DEFAULT_SAMPLES = 10_000
"""Samples in a generated dataset: enough for steady-state windows, generated in well under a second."""

DEFAULT_DATASET = "cifar10-like"
DEFAULT_IMAGE_SIZE = 32
DEFAULT_ROOT = "data"

_FILE_DATASETS = ("cifar10", "imagefolder")

log = logging.getLogger("autotune")


class UsageError(Exception):
    """A value the user gave cannot be used; reported like argparse's own errors (exit 2)."""


class UserCodeError(Exception):
    """The user's dataset factory raised; reported as a failed run (exit 1)."""


# --------------------------------------------------------------------------------------------------
# Argument parsing


def _batch_size(text: str) -> int | None:
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a batch size; give a positive integer, or 'auto' to search it"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a batch size; it must be at least 1")
    return value


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} must be at least {minimum}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _loader_settings(text: str) -> dict[str, Any]:
    """``num_workers=16,pin_memory=True`` as a dict of DataLoader settings (ints, booleans, None)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(
                f"{part!r} is not KEY=VALUE; write the settings as num_workers=16,pin_memory=True")
        value = value.strip()
        parsed: Any = {"true": True, "false": False, "none": None}.get(value.lower(), value)
        if isinstance(parsed, str):
            try:
                parsed = int(parsed)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{key.strip()}={value!r}: a value is an integer, True, False or None") from None
        out[key.strip()] = parsed
    return out


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive, finite number of seconds")
    return value


def _add_cache_dir_flag(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    p.add_argument("--cache-dir", metavar="DIR",
                   help="profile folder (default: $AUTOTUNE_CACHE_DIR, else the user cache folder)")


def _add_store_flags(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    _add_cache_dir_flag(p)
    p.add_argument("--storage", metavar="URL",
                   help="an Optuna RDB storage URL for shared profiles, e.g. postgresql://host/db")


def _build_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The parser, and each sub-command's parser by name (for its usage line in errors)."""
    from . import __version__
    from .result import DEFAULT_BUDGET_S, DEFAULT_EPOCHS

    parser = argparse.ArgumentParser(
        prog="autotune",
        description="Find the fastest PyTorch DataLoader settings for this machine, by measuring them.",
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tune = sub.add_parser(
        "tune",
        help="tune a DataLoader and print the best settings",
        description="Measure DataLoader settings for a dataset (by default a generated CIFAR-10-shaped"
        " one, nothing is downloaded) and print the trials, the best settings and the speed-up.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent("""\
            datasets (--dataset):
              cifar10-like        CIFAR-10-shaped images generated in memory (the default)
              latency, tensor     the other built-in workloads (slow storage; an in-memory tensor)
              cifar10             torchvision's CIFAR-10 files under --root (never downloaded)
              imagefolder:PATH    an ImageFolder of class sub-folders, cropped to --image-size
              fake                torchvision FakeData, 32x32, with the CIFAR-10 training transform
              module:callable     import module, call callable(): a dataset or a (dataset, step) pair

            the built-in and file datasets train a small CNN on each batch unless --no-step.
            """),
    )
    data = tune.add_argument_group("workload")
    data.add_argument("--dataset", default=DEFAULT_DATASET, metavar="SPEC",
                      help=f"what to load (default: {DEFAULT_DATASET}; see below)")
    data.add_argument("--root", default=DEFAULT_ROOT, metavar="DIR",
                      help="folder holding cifar-10-batches-py, for --dataset cifar10"
                      f" (default: {DEFAULT_ROOT})")
    data.add_argument("--samples", type=_positive_int, metavar="N",
                      help="size of a generated dataset"
                      f" (default: {DEFAULT_SAMPLES} for cifar10-like and fake)")
    data.add_argument("--image-size", type=_positive_int, default=DEFAULT_IMAGE_SIZE, metavar="N",
                      help=f"crop size for imagefolder (default: {DEFAULT_IMAGE_SIZE})")
    data.add_argument("--no-step", action="store_true",
                      help="measure loading alone, without a training step")

    search = tune.add_argument_group("search")
    search.add_argument("--batch-size", type=_batch_size, default=None, metavar="N|auto",
                        help="fix the batch size, or 'auto' to search it (default: auto)")
    search.add_argument("--budget", type=_seconds, default=DEFAULT_BUDGET_S, metavar="SECONDS",
                        help=f"wall-clock seconds for the whole search (default: {DEFAULT_BUDGET_S:g})")
    search.add_argument("--device", metavar="DEVICE",
                        help="where batches go before the step: cpu, cuda, cuda:N"
                        " (default: cuda if available)")
    search.add_argument("--epochs", type=_positive_int, default=DEFAULT_EPOCHS, metavar="N",
                        help=f"training length start-up costs are amortised over (default: {DEFAULT_EPOCHS})")
    search.add_argument("--max-workers", type=_non_negative_int, metavar="N",
                        help="upper bound on num_workers (default: derived from the usable CPUs)")
    search.add_argument("--seed", type=int, default=0, help="seed for the sampler and data (default: 0)")
    search.add_argument("--baseline", type=_loader_settings, default=None, metavar="K=V[,K=V]",
                        help="the DataLoader settings you run now, e.g. num_workers=16,pin_memory=True:"
                        " measured and compared against (default: PyTorch's defaults)")

    cache = tune.add_argument_group("profile cache")
    cache.add_argument("--no-cache", action="store_true",
                       help="neither read nor store a profile")
    cache.add_argument("--retune", action="store_true",
                       help="measure even if a profile is stored, and replace it")
    _add_store_flags(cache)

    out = tune.add_argument_group("output")
    out.add_argument("--json", action="store_true",
                     help="print one JSON document on stdout and nothing else")
    out.add_argument("--plot", metavar="FILE", help="save throughput and busy-fraction plots (PNG)")
    out.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    out.add_argument("-v", "--verbose", action="store_true", help="log what the search does (stderr)")

    profiles = sub.add_parser(
        "profiles", help="list, show or clear stored profiles",
        description="The profiles remembered per machine and workload.",
    )
    psub = profiles.add_subparsers(dest="action", metavar="ACTION")
    p_list = psub.add_parser("list", help="one line per stored profile",
                             description="One line per stored profile, newest first.")
    p_list.add_argument("--json", action="store_true", help="print the summaries as JSON")
    _add_store_flags(p_list)
    p_show = psub.add_parser("show", help="everything stored for one profile",
                             description="The machine and workload fingerprints and the stored result.")
    p_show.add_argument("key", help="a key from `autotune profiles list`")
    p_show.add_argument("--json", action="store_true", help="print the stored record as JSON")
    _add_store_flags(p_show)
    p_clear = psub.add_parser("clear", help="remove one profile, or all with --all",
                              description="Remove one profile by key, or every profile with --all.")
    p_clear.add_argument("key", nargs="?", help="the profile to remove")
    p_clear.add_argument("--all", action="store_true", help="remove every stored profile")
    _add_store_flags(p_clear)
    nodes = sub.add_parser(
        "cache", help="list or clear the decoded caches kept for this node",
        description="The ram caches kept between runs, shared by every process on this node.",
    )
    csub = nodes.add_subparsers(dest="action", metavar="ACTION")
    c_list = csub.add_parser("list", help="one line per cache, most recently used first",
                             description="One line per node cache, most recently used first.")
    c_list.add_argument("--json", action="store_true", help="print the caches as JSON")
    _add_cache_dir_flag(c_list)
    c_clear = csub.add_parser("clear", help="remove every node cache",
                              description="Remove every node cache; a running process that maps one"
                              " keeps its memory until it exits.")
    _add_cache_dir_flag(c_clear)
    run = _add_run_parser(sub)
    return parser, {"tune": tune, "profiles": profiles, "list": p_list, "show": p_show, "clear": p_clear,
                    "run": run, "cache": nodes}


def _add_run_parser(sub: Any) -> argparse.ArgumentParser:
    """``autotune run``: everything after SCRIPT (or after ``-m MODULE --``) is the script's."""
    from .loader import MIN_TUNE_BATCHES

    run = sub.add_parser(
        "run",
        help="run a training script with its DataLoaders tuned while it trains",
        usage="autotune run [options] SCRIPT [ARGS...]\n       autotune run [options] -m MODULE [-- ARGS...]",
        description=textwrap.dedent("""\
            Run a Python script (or module) as `python` would, in this process, with
            torch.utils.data.DataLoader standing for autotune's self-tuning DataLoader: each loader
            the script builds is tuned inside its own epochs. At the end, the best settings found for
            each are printed on stderr with the lines to paste. The script's stdout, exceptions and
            exit code are its own."""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=textwrap.dedent(f"""\
            what is tuned and what is kept:
              num_workers, prefetch_factor, pin_memory and persistent_workers written in the script
              are starting points: they are measured and searched around (worker threads and a
              pre-transform cache too). batch_size, shuffle, samplers, collate_fn, drop_last and
              every other argument are the script's and never change.

            subclasses of DataLoader (the script's own, torchdata's StatefulDataLoader) are left as
            they are. A loader needs {MIN_TUNE_BATCHES} batches to be tuned: one iterated less (an
            evaluation loader read once) is reported as too short, not guessed. Profiles are stored
            per machine and workload ($AUTOTUNE_CACHE_DIR, else the user cache folder), so the next
            run starts at the best.

            examples:
              autotune run train.py --epochs 1
              autotune run --stop-when-tuned --json tuned.json train.py --epochs 90
              autotune run -m mypkg.train -- --lr 0.1
            """),
    )
    run.add_argument("-m", dest="module", metavar="MODULE",
                     help="run a module as `python -m MODULE` does; its arguments follow `--`")
    run.add_argument("--epochs", type=_positive_int, default=None, metavar="N",
                     help="how many epochs the script trains (default: 10): exploring and start-up are"
                     " weighed against that length")
    run.add_argument("--stop-when-tuned", action="store_true",
                     help="end the script once every DataLoader it iterates has settled (its finally"
                     " blocks still run; exit code 0)")
    run.add_argument("--json", metavar="PATH",
                     help="also write the report as one JSON document to PATH (stdout is the script's)")
    run.add_argument("--quiet", action="store_true",
                     help="no line on stderr while the script runs; the report at the end still is")
    run.add_argument("-v", "--verbose", action="store_true", help="log what the tuning does (stderr)")
    run.add_argument("script", nargs="?", metavar="SCRIPT", help="the script to run, as for `python`")
    run.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="the script's arguments")
    return run


# --------------------------------------------------------------------------------------------------
# Datasets


@dataclass(frozen=True)
class LoadedWorkload:
    dataset: Any
    step: Callable[[Any], Any] | None


def _resolve_device(text: str | None) -> str:
    import torch

    if text is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(text)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device {text!r} is not a torch device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text!r} but CUDA is not available on this machine; use --device cpu")
    return str(dev)


def _small_cnn_step(classes: int, device: str, seed: int) -> Callable[[Any], Any]:
    import torch

    from .workloads import SmallCNN, make_train_step

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = SmallCNN(num_classes=classes)
    return make_train_step(model, device=device)


def _import_factory(spec: str) -> Callable[[], Any]:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise UsageError(f"--dataset {spec!r}: write module:callable, e.g. mypkg.data:make_dataset")
    # As `python -m` does: modules in the current folder are importable.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise UsageError(
                f"--dataset {spec!r}: no module named {err.name!r}; check the name, and run from the"
                " folder that holds it or install it"
            ) from err
        raise UserCodeError(f"importing {module_name} failed: {type(err).__name__}: {err}") from err
    except Exception as err:
        raise UserCodeError(f"importing {module_name} failed: {type(err).__name__}: {err}") from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--dataset {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--dataset {spec!r}: {attr!r} is a {type(obj).__name__}, not a callable")
    return obj


def load_workload(args: argparse.Namespace, device: str) -> LoadedWorkload:
    """The dataset and step that ``--dataset`` (and the flags around it) name."""
    from . import workloads

    spec: str = args.dataset
    name, _, rest = spec.partition(":")
    generated = spec in workloads.WORKLOADS or spec == "fake"
    if args.samples is not None and not generated:
        raise UsageError(
            f"--samples applies to generated datasets ({', '.join([*workloads.WORKLOADS, 'fake'])});"
            f" --dataset {spec!r} has the size of its files"
        )
    if spec in workloads.WORKLOADS:
        kwargs: dict[str, Any] = {"device": device} if spec != "latency" else {}
        if args.samples is not None or spec == DEFAULT_DATASET:
            kwargs["n"] = args.samples or DEFAULT_SAMPLES
        if spec != "latency":
            kwargs["seed"] = args.seed
        w = workloads.get_workload(spec, **kwargs)
        return LoadedWorkload(w.dataset, None if args.no_step else w.step)
    if spec == "fake":
        import torchvision

        dataset = torchvision.datasets.FakeData(
            size=args.samples or DEFAULT_SAMPLES, image_size=(3, 32, 32), num_classes=10,
            transform=workloads.cifar_train_transform(), random_offset=args.seed,
        )
        step = None if args.no_step else _small_cnn_step(10, device, args.seed)
        return LoadedWorkload(dataset, step)
    if spec == "cifar10":
        try:
            dataset = workloads.CIFAR10Files(args.root, train=True,
                                             transform=workloads.cifar_train_transform())
        except FileNotFoundError as err:
            raise UsageError(str(err)) from err
        step = None if args.no_step else _small_cnn_step(len(dataset.classes), device, args.seed)
        return LoadedWorkload(dataset, step)
    if name == "imagefolder":
        if not rest:
            raise UsageError("--dataset imagefolder:PATH needs the folder, e.g. imagefolder:/data/train")
        try:
            w = workloads.imagefolder_workload(rest, size=args.image_size, device=device, seed=args.seed)
        except FileNotFoundError as err:
            raise UsageError(str(err)) from err
        return LoadedWorkload(w.dataset, None if args.no_step else w.step)
    if name in _FILE_DATASETS or not rest:
        choices = ", ".join([*workloads.WORKLOADS, "fake", "cifar10", "imagefolder:PATH", "module:callable"])
        raise UsageError(f"--dataset {spec!r} is not a dataset autotune knows; use one of {choices}")
    factory = _import_factory(spec)
    try:
        made = factory()
    except Exception as err:
        raise UserCodeError(f"{spec}() raised {type(err).__name__}: {err}") from err
    step = None
    if isinstance(made, tuple) and len(made) == 2 and (made[1] is None or callable(made[1])):
        made, step = made
    return LoadedWorkload(made, None if args.no_step else step)


# --------------------------------------------------------------------------------------------------
# Commands


def _print(*lines: str) -> None:
    for line in lines:
        print(line)


def _err(message: str) -> None:
    print(f"autotune: {message}", file=sys.stderr)


def _describe_exception(err: BaseException) -> str:
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    text = f"{type(err).__name__}: {lines[0].strip()}" if lines else type(err).__name__
    if len(lines) > 1 and "worker process" in lines[0]:
        text = f"{type(err).__name__} in a worker: {lines[-1].strip()}"
    notes: list[str] = [n for n in getattr(err, "__notes__", []) if isinstance(n, str)]
    return "\n".join([text, *notes])


def cmd_tune(args: argparse.Namespace) -> int:
    from . import report
    from .api import tune_loader
    from .machine import detect_machine

    if args.no_cache and args.retune:
        raise UsageError("--no-cache and --retune contradict each other; give one of them")
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        # Said before tuning, not after: a finished run's results must not be lost to a typo.
        raise UsageError(f"--plot {args.plot!r}: its folder does not exist; create it or give another path")
    device = _resolve_device(args.device)
    # With --json, stdout carries one JSON document: anything the user's code prints goes to stderr.
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect:
        workload = load_workload(args, device)
        if not args.quiet:
            # What bounds the search in a container: the CPU quota, the memory limit, /dev/shm.
            _err(f"limits: {detect_machine().limits_line()}")
        result = tune_loader(
            workload.dataset,
            workload.step,
            batch_size=args.batch_size,
            budget_s=args.budget,
            device=device,
            cache=not args.no_cache,
            cache_dir=args.cache_dir,
            storage=args.storage,
            retune=args.retune,
            epochs=args.epochs,
            max_workers=args.max_workers,
            seed=args.seed,
            progress=not args.quiet,
            baseline=args.baseline,
        )
        if args.plot:
            path = result.plot(args.plot)
            if not args.quiet:
                print(f"autotune: plot saved to {path}", file=sys.stderr)
    if args.json:
        _print(report.to_json(result))
        return EXIT_OK
    _print(result.table(), "", report.summary_text(result), "", report.dashboard_hint(result))
    if args.plot:
        _print(f"Plot: {args.plot}")
    return EXIT_OK


def _open_store(args: argparse.Namespace) -> Any:
    from . import profiles

    return profiles.open_store(cache_dir=args.cache_dir, storage=args.storage)


def _fmt_kwargs(kwargs: Any) -> str:
    if not isinstance(kwargs, dict):
        return "-"
    short = {"batch_size": "bs", "num_workers": "w", "pin_memory": "pin", "prefetch_factor": "pf",
             "persistent_workers": "persist"}
    parts: list[str] = []
    for k, v in kwargs.items():
        if isinstance(v, bool):
            if v:
                parts.append(short.get(k, str(k)))
        elif v is not None:
            parts.append(f"{short.get(k, str(k))}={v}")
    return " ".join(parts) or "-"


def _fmt_machine(machine: Any) -> str:
    if not isinstance(machine, dict):
        return "-"
    cpus = f"{machine.get('usable_cpus', '?')} cpu"
    acc = machine.get("accelerator")
    if acc and acc != "none":
        count = machine.get("accelerator_count") or 1
        name = machine.get("accelerator_name") or acc
        return f"{cpus}, {count}x {name}"
    return cpus


def _fmt_workload(workload: Any) -> str:
    if not isinstance(workload, dict):
        return "-"
    dataset = str(workload.get("dataset") or "?").rsplit(".", 1)[-1]
    length = workload.get("len")
    return f"{dataset}[{length}]" if length is not None else dataset


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        cols = enumerate(zip(cells, widths, strict=True))
        return "  ".join(f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in cols).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def cmd_profiles_list(args: argparse.Namespace) -> int:
    store = _open_store(args)
    try:
        summaries = store.list()
    finally:
        store.close()
    if args.json:
        _print(json.dumps(summaries, indent=2, default=str))
        return EXIT_OK
    if not summaries:
        _print(f"No stored profiles in {store.location}; `autotune tune` stores one.")
        return EXIT_OK
    rows = []
    for s in summaries:
        sps = s.get("samples_per_s")
        rows.append([
            str(s.get("key")),
            str(s.get("created") or "-").replace("+00:00", "Z"),
            _fmt_machine(s.get("machine")),
            _fmt_workload(s.get("workload")),
            _fmt_kwargs(s.get("loader_kwargs")),
            f"{sps:,.0f}" if isinstance(sps, (int, float)) else "-",
        ])
    _print(_table(["key", "created", "machine", "workload", "best", "samples/s"], rows, right=(5,)),
           "", f"{len(rows)} profile{'s' if len(rows) != 1 else ''} in {store.location};"
           " `autotune profiles show KEY` for one in full.")
    return EXIT_OK


def _fingerprint_lines(data: Any, indent: str = "  ") -> list[str]:
    if not isinstance(data, dict) or not data:
        return [f"{indent}-"]
    width = max(len(str(k)) for k in data)
    lines = []
    for k, v in data.items():
        text = v if isinstance(v, str) else json.dumps(v, default=str, sort_keys=True)
        lines.append(f"{indent}{str(k):<{width}}  {text}")
    return lines


def cmd_profiles_show(args: argparse.Namespace) -> int:
    from . import report
    from .result import TuneResult

    store = _open_store(args)
    try:
        record = store.get(args.key)
    finally:
        store.close()
    if record is None:
        _err(
            f"no profile with key {args.key!r} in {store.location}; `autotune profiles list` shows the"
            " stored keys."
        )
        return EXIT_FAILED
    if args.json:
        _print(json.dumps(record, indent=2, default=str))
        return EXIT_OK
    result = TuneResult.from_dict(record, from_cache=True)
    _print(
        f"Profile {args.key}  (created {record.get('created', '?')}, in {store.location})",
        "",
        "Machine:",
        *_fingerprint_lines(record.get("machine")),
        "",
        "Workload:",
        *_fingerprint_lines(record.get("workload")),
        "",
        report.summary_text(result),
        "",
        report.dashboard_hint(result),
    )
    return EXIT_OK


def cmd_profiles_clear(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.key is None and not args.all:
        parser.error("give the KEY of one profile to remove, or --all to remove every profile")
    if args.key is not None and args.all:
        parser.error("give either a KEY or --all, not both")
    store = _open_store(args)
    try:
        if args.all:
            removed = store.clear()
            _print(f"Removed {removed} profile{'s' if removed != 1 else ''} from {store.location}.")
            return EXIT_OK
        if not store.delete(args.key):
            _err(
                f"no profile with key {args.key!r} in {store.location}; `autotune profiles list` shows"
                " the stored keys."
            )
            return EXIT_FAILED
        _print(f"Removed profile {args.key} from {store.location}.")
        return EXIT_OK
    finally:
        store.close()


def cmd_cache_list(args: argparse.Namespace) -> int:
    from .machine import format_bytes
    from .pretransform import node

    found = node.entries(args.cache_dir)
    where = ", ".join(str(f) for f in node.folders(args.cache_dir))
    if args.json:
        _print(json.dumps([e.__dict__ for e in found], indent=2, default=str))
        return EXIT_OK
    if not found:
        _print(f"No node caches in {where}; a loader that caches its samples (pretransform='ram') keeps"
               " one there.")
        return EXIT_OK
    rows = [[
        os.path.basename(e.path).removesuffix(node.SUFFIX)[:12],
        format_bytes(e.bytes),
        f"{e.filled}/{e.total}",
        _ago(e.last_used),
        "yes" if e.in_use else "no",
        e.detail[:60] + ("..." if len(e.detail) > 60 else ""),
    ] for e in found]
    total = sum(e.bytes for e in found)
    _print(_table(["key", "size", "filled", "last used", "in use", "cached"], rows, right=(1, 2)),
           "", f"{len(rows)} cache{'s' if len(rows) != 1 else ''}, {format_bytes(total)}, in {where};"
           " `autotune cache clear` removes them.")
    return EXIT_OK


def _ago(when: float) -> str:
    import time

    seconds = max(0.0, time.time() - when)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


def cmd_cache_clear(args: argparse.Namespace) -> int:
    from .machine import format_bytes
    from .pretransform import node

    removed = node.clear(args.cache_dir)
    in_use = sum(1 for e in removed if e.in_use)
    note = (f"; {in_use} {'is' if in_use == 1 else 'are'} still mapped by a running process, whose"
            " memory comes back when it exits" if in_use else "")
    _print(f"Removed {len(removed)} node cache{'s' if len(removed) != 1 else ''}"
           f" ({format_bytes(sum(e.bytes for e in removed))}){note}.")
    return EXIT_OK


def cmd_run(args: argparse.Namespace) -> int:
    """``autotune run``: the script's own exit code (see NOTE [ autotune run ] in run.py)."""
    from .run import Target, TargetError, run

    rest = [a for a in [args.script, *args.args] if a is not None]
    if args.module is not None:
        if rest[:1] == ["--"]:
            rest = rest[1:]
        target_kw: dict[str, Any] = {"module": args.module}
    else:
        if not rest:
            raise UsageError("give the script to run (autotune run train.py), or -m MODULE")
        target_kw = {"script": rest.pop(0)}
    if args.json is not None and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        raise UsageError(f"--json {args.json!r}: its folder does not exist; create it or give another path")
    try:
        outcome = run(Target(args=tuple(rest), **target_kw), json_path=args.json,
                      stop_when_tuned=args.stop_when_tuned, quiet=args.quiet, epochs=args.epochs)
    except TargetError as err:
        raise UsageError(str(err)) from err
    return outcome.exit_code


# --------------------------------------------------------------------------------------------------
# Entry point


@contextlib.contextmanager
def _logging(verbose: bool) -> Iterator[None]:
    if not verbose:
        yield
        return
    logger = logging.getLogger("autotune")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


def _dispatch(
    args: argparse.Namespace, parser: argparse.ArgumentParser, subs: dict[str, argparse.ArgumentParser]
) -> int:
    commands: dict[str, Callable[[argparse.Namespace], int]] = {"tune": cmd_tune, "run": cmd_run}
    if args.command in commands:
        try:
            return commands[args.command](args)
        except UsageError as err:
            subs[args.command].print_usage(sys.stderr)
            _err(f"error: {err}")
            return EXIT_USAGE
    if args.command == "profiles":
        if args.action == "list":
            return cmd_profiles_list(args)
        if args.action == "show":
            return cmd_profiles_show(args)
        if args.action == "clear":
            return cmd_profiles_clear(args, subs["clear"])
        subs["profiles"].print_usage(sys.stderr)
        _err("error: give an action: list, show KEY or clear [KEY | --all]")
        return EXIT_USAGE
    if args.command == "cache":
        if args.action == "list":
            return cmd_cache_list(args)
        if args.action == "clear":
            return cmd_cache_clear(args)
        subs["cache"].print_usage(sys.stderr)
        _err("error: give an action: list or clear")
        return EXIT_USAGE
    parser.print_usage(sys.stderr)
    _err("error: give a command: tune, run, profiles or cache (autotune --help for more)")
    return EXIT_USAGE


def main(argv: list[str] | None = None) -> int:
    """Run the ``autotune`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    from .exceptions import ConfigurationError, ProfileStoreError, TuningFailed

    parser, subs = _build_parsers()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, --version, and argparse's usage errors
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    verbose = bool(getattr(args, "verbose", False))
    try:
        with _logging(verbose):
            return _dispatch(args, parser, subs)
    except SystemExit as exit_:  # parser.error() in a command
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    except KeyboardInterrupt:
        _err("interrupted")
        return EXIT_INTERRUPTED
    except ConfigurationError as err:
        _err(f"error: {err}")
        return EXIT_USAGE
    except (TuningFailed, UserCodeError) as err:
        _err(f"tuning failed: {err}")
        return EXIT_FAILED
    except ProfileStoreError as err:
        _err(f"error: {err}")
        return EXIT_FAILED
    except ImportError as err:  # e.g. --plot without matplotlib
        _err(f"error: {err}")
        return EXIT_FAILED
    except Exception as err:  # the user's dataset or step, raised under every candidate
        if verbose:
            traceback.print_exception(err, file=sys.stderr)
        _err(f"tuning failed: {_describe_exception(err)}")
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover - `python -m autotune` goes through __main__.py
    sys.exit(main())
