"""What the benchmark scripts share: where they write, their options' defaults, and how they describe
the machine."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.machine import detect_machine

RESULTS_DIR = Path(__file__).resolve().parent.parent / "results"
"""Where full runs write their committed pages and figures: one folder per script (see
``benchmarks/__init__.py``)."""


def results_folder(script: str) -> Path:
    """``benchmarks/results/<name>/`` for the script whose ``__file__`` is ``script``: the folder that
    script alone writes, named after it so that the one is found from the other."""
    return RESULTS_DIR / Path(script).stem


def out_folder(args: argparse.Namespace, script: str, quick_prefix: str) -> Path:
    """``--out``, else a new temporary folder for a smoke run (its figures mean nothing), else the
    script's committed results folder (``results_folder``)."""
    if args.out is not None:
        return Path(args.out)
    return Path(tempfile.mkdtemp(prefix=quick_prefix)) if args.quick else results_folder(script)


def add_out(parser: argparse.ArgumentParser, script: str) -> None:
    """``--out DIR``, by default the results folder of the script whose ``__file__`` is ``script``."""
    name = Path(script).stem
    parser.add_argument("--out", type=Path, default=results_folder(script),
                        help=f"folder for {name.upper()}.md and {name}.json"
                        f" (default: benchmarks/results/{name}/)")


def add_render(parser: argparse.ArgumentParser, page: str) -> None:
    """``--render JSON``: measure nothing, write ``page`` again from the figures of an earlier run."""
    parser.add_argument("--render", type=Path, default=None, metavar="JSON",
                        help=f"measure nothing: write {page} again beside the JSON of an earlier run")


def render(args: argparse.Namespace, page: str, write: Callable[[Any, Path], None]) -> bool:
    """Write ``page`` with ``write`` beside the figures ``--render`` names; whether it was asked for."""
    if args.render is None:
        return False
    source = Path(args.render)
    write(json.loads(source.read_text()), source.with_name(page))
    return True


def fill_in(args: argparse.Namespace, quick: dict[str, Any], full: dict[str, Any]) -> None:
    """Give each option left unset on the command line its value: the smoke run's with ``--quick``,
    else the full run's."""
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def require_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """Exit with a usage error when a count given on the command line is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")


def describe_machine() -> str:
    """The machine in one line, for a results file."""
    m = detect_machine()
    return (f"{m.usable_cpus} usable CPUs of a {m.cpu_model}, {m.ram_total_bytes / 2**30:.1f} GiB RAM,"
            f" accelerator {m.accelerator}, torch {m.torch_version}")


def quick_notice(quick: bool) -> list[str]:
    """The line a smoke run's page opens with, and a blank one; nothing for a full run."""
    return ["**Quick mode**: a smoke run on tiny sizes; its figures mean nothing.", ""] if quick else []


def load_average() -> list[float]:
    """The 1, 5 and 15 minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]
