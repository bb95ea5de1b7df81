"""The node cache: a second process, five runs in a row, two ranks, and a fill killed with SIGKILL.

    python benchmarks/scripts/node.py [--n 10000] [--epochs 5] [--rounds 5] [--runs 5]
                                      [--place-n 50000] [--quick]
                                      [--out DIR] [--render JSON]

Writes NODE.md and node.json to ``benchmarks/results/node/`` (``--out`` elsewhere; ``--quick``: a smoke
run into a temporary folder).

# NOTE [ Node benchmark protocol ]
# The loop: CIFAR10Like(n) with the standard training transform, ``autotune.DataLoader(ds,
# batch_size=64, shuffle=True)`` (nothing written), a linear model's SGD step, ``--epochs`` epochs,
# each run a new process. Every part starts from a new profile folder (and so new node caches).
# 1. Second process: run 1 from nothing, then run 2 with the cache (the default) and run 2 with
#    AUTOTUNE_NODE_CACHE=off (each process its own cache, as before), in an order rotated per
#    round. Per run: its first epoch against the median of its later epochs.
# 2. Runs in a row: ``--runs`` runs of the loop with the drop-in and as many with torch's DataLoader
#    and the same arguments, alternated; each run's wall time, start-up included.
# 3. Ranks: ``torchrun --nproc-per-node=2``, each rank ``pretransform="ram"`` over its
#    DistributedSampler shard; per epoch its time, the cache's fill counts after the epoch (on
#    rank 0) and, after the last epoch, each rank's USS and PSS and the cache's size; with the node
#    cache and with it off.
# 4. SIGKILL: a process filling the cache of a deterministic pipeline with two worker processes is
#    killed (its process group) after its first batches; a rerun reads the fill counts it left, serves
#    one epoch with two workers, and compares the batches' hash with torch's DataLoader over the
#    dataset itself.
# 5. Where a cache lives: the bytes of a CIFAR10Like(--place-n) cache (fixed-shape rows; by default
#    CIFAR-10's 50,000, about 600 MB) written row block by
#    row block, as a pass fills it, into a file in /dev/shm, into torch's anonymous shared memory,
#    and into a file under the profile folder on disk, each mapped and reserved as a cache is; then
#    the file read back in random row blocks by a new process. Rotated, --rounds times.
# Ratios are of medians measured in the same run; the load average is written with them.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import harness  # noqa: E402
from benchmarks._common.stats import rotated  # noqa: E402

SCRIPT = str(Path(__file__).resolve())


# ------------------------------------------------------------------------------------ child modes


def _dataset(n: int, plain: bool = False) -> Any:
    import torchvision.transforms as T

    from autotune.workloads import CIFAR_MEAN, CIFAR_STD, CIFAR10Like, cifar_train_transform

    if plain:
        return CIFAR10Like(n, transform=T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]))
    return CIFAR10Like(n, transform=cifar_train_transform())


def _loop(n: int, epochs: int, plain_torch: bool) -> dict[str, Any]:
    """The user's loop: per-epoch seconds."""
    import torch

    import autotune

    t_start = time.perf_counter()
    ds = _dataset(n)
    model = torch.nn.Linear(3 * 32 * 32, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kind = torch.utils.data.DataLoader if plain_torch else autotune.DataLoader
    loader = kind(ds, batch_size=64, shuffle=True)
    times = [_train(loader, model, opt) for _ in range(epochs)]
    return {"epochs": times, "in_process_s": time.perf_counter() - t_start}


def _train(loader: Any, model: Any, opt: Any) -> float:
    """One epoch of a linear model's SGD steps; its seconds."""
    import torch

    t0 = time.perf_counter()
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return time.perf_counter() - t0


def _digest(batches: Any) -> str:
    h = hashlib.sha256()
    for x, y in batches:
        h.update(x.contiguous().view(-1).numpy().tobytes())
        h.update(y.numpy().tobytes())
    return h.hexdigest()


def _kill_child(n: int, mode: str) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    from autotune import pretransform as pt

    ds = _dataset(n, plain=True)
    prepared = pt.prepare(ds, "ram", device=torch.device("cpu"), fill="pass")
    before = prepared.fill_counts()

    def epoch(dataset: Any, collate: Any) -> Any:
        gen = torch.Generator().manual_seed(7)
        return DataLoader(dataset, batch_size=64, shuffle=True, num_workers=2, collate_fn=collate,
                          generator=gen)

    if mode == "fill":
        for k, _ in enumerate(epoch(prepared.dataset, prepared.collate_fn)):
            if k == 3:
                print("filling", flush=True)
        time.sleep(3600)
    ours = _digest(epoch(prepared.dataset, prepared.collate_fn))
    theirs = _digest(epoch(ds, None))
    after = prepared.fill_counts()
    return {"before": [before.filled, before.total], "after": [after.filled, after.total],
            "same_as_torch": ours == theirs}


def _rank_child(n: int, epochs: int, out: str) -> None:
    from datetime import timedelta

    import psutil
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler

    import autotune
    from autotune.pretransform import node

    dist.init_process_group("gloo", timeout=timedelta(seconds=300))
    rank = dist.get_rank()
    ds = _dataset(n)
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    loader = autotune.DataLoader(ds, batch_size=64, sampler=sampler, pretransform="ram")
    model = torch.nn.Linear(3 * 32 * 32, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    times, fills = [], []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        dist.barrier()
        times.append(_train(loader, model, opt))
        dist.barrier()
        fills.append([(e.filled, e.total) for e in node.entries()])
    mem = psutil.Process().memory_full_info()
    children = psutil.Process().children(recursive=True)
    child_uss = sum(c.memory_full_info().uss for c in children if c.is_running())
    caches = [e.bytes for e in node.entries()]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "epochs": times, "fills": fills, "uss": mem.uss, "pss": mem.pss,
                   "rss": mem.rss, "shared": mem.shared, "children_uss": child_uss, "node_bytes": caches}, fh)
    dist.barrier()
    loader.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- parent


def _child(args: list[str], env: dict[str, str], timeout: float = 1800) -> dict[str, Any]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, SCRIPT, "--child", *args], capture_output=True, text=True,
                         env={**os.environ, "PYTHONWARNINGS": "ignore", **env}, timeout=timeout, check=False)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["wall_s"] = wall
    return result


def _fresh() -> dict[str, str]:
    return {"AUTOTUNE_CACHE_DIR": tempfile.mkdtemp(prefix="autotune-node-bench-")}


def _clear(env: dict[str, str]) -> None:
    from autotune.pretransform import node

    node.clear(env["AUTOTUNE_CACHE_DIR"])
    shutil.rmtree(env["AUTOTUNE_CACHE_DIR"], ignore_errors=True)


def _first_vs_settled(epochs: list[float]) -> float:
    return epochs[0] / statistics.median(epochs[1:])


def second_process(n: int, epochs: int, rounds: int) -> dict[str, Any]:
    rows = []
    for r in range(rounds):
        env = _fresh()
        try:
            first = _child(["loop", str(n), str(epochs), "dropin"], env)
            row: dict[str, Any] = {"run1": first["epochs"]}
            for arm in rotated(["node", "off"], r):
                extra = {} if arm == "node" else {"AUTOTUNE_NODE_CACHE": "off"}
                second = _child(["loop", str(n), str(epochs), "dropin"], {**env, **extra})
                row[f"run2_{arm}"] = second["epochs"]
            rows.append(row)
        finally:
            _clear(env)
        print(f"  round {r + 1}: run 2 first/settled {_first_vs_settled(row['run2_node']):.2f}x with the node"
              f" cache, {_first_vs_settled(row['run2_off']):.2f}x without", flush=True)
    return {
        "rounds": rows,
        "second_first_vs_settled": statistics.median(_first_vs_settled(r["run2_node"]) for r in rows),
        "second_first_vs_settled_off": statistics.median(_first_vs_settled(r["run2_off"]) for r in rows),
        "second_first_s": statistics.median(r["run2_node"][0] for r in rows),
        "second_first_off_s": statistics.median(r["run2_off"][0] for r in rows),
        "settled_s": statistics.median(statistics.median(r["run2_node"][1:]) for r in rows),
    }


def in_a_row(n: int, epochs: int, runs: int) -> dict[str, Any]:
    env = _fresh()
    dropin, plain = [], []
    try:
        for r in range(runs):
            for arm in rotated(["dropin", "torch"], r):
                res = _child(["loop", str(n), str(epochs), arm], env)
                (dropin if arm == "dropin" else plain).append(res["wall_s"])
            print(f"  run {r + 1}: drop-in {dropin[-1]:.1f} s, torch {plain[-1]:.1f} s", flush=True)
    finally:
        _clear(env)
    ratios = [d / p for d, p in zip(dropin, plain, strict=True)]
    return {"dropin_s": dropin, "torch_s": plain, "ratios": ratios, "total_ratio": sum(dropin) / sum(plain)}


def ranks(n: int, epochs: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm in ("node", "off"):
        env = _fresh()
        work = tempfile.mkdtemp(prefix="autotune-node-ranks-")
        try:
            exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
            cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
            cmd += ["--nproc-per-node=2", "--master-port", str(29500 + os.getpid() % 1000), SCRIPT, "--child",
                    "rank", str(n), str(epochs), work]
            extra = {} if arm == "node" else {"AUTOTUNE_NODE_CACHE": "off"}
            subprocess.run(cmd, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore", **env, **extra},
                           timeout=1800, capture_output=True)
            ranks_ = [json.loads(Path(work, f"rank{k}.json").read_text()) for k in (0, 1)]
        finally:
            _clear(env)
            shutil.rmtree(work, ignore_errors=True)
        out[arm] = {"ranks": ranks_, "pss_total": sum(r["pss"] for r in ranks_),
                    "uss_total": sum(r["uss"] for r in ranks_)}
        print(f"  {arm}: PSS {out[arm]['pss_total'] / 2**20:.0f} MiB in all, epochs rank 0"
              f" {', '.join(f'{t:.2f}' for t in ranks_[0]['epochs'])}", flush=True)
    return out


def killed(n: int) -> dict[str, Any]:
    env = _fresh()
    try:
        proc = subprocess.Popen([sys.executable, SCRIPT, "--child", "kill", str(n), "fill"],
                                stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
        assert proc.stdout is not None
        with proc.stdout:
            line = proc.stdout.readline().strip()
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        if line != "filling":
            raise RuntimeError("the filling process ended before it was killed")
        rerun = _child(["kill", str(n), "check"], env)
        again = _child(["kill", str(n), "check"], env)
    finally:
        _clear(env)
    return {"rerun": rerun, "third": again}


def _secs(values: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in values)


PLACE_CHILD = """
import os, sys, time, torch, numpy as np
path, size, row = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t0 = time.perf_counter()
fd = os.open(path, os.O_RDWR)
storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
os.close(fd)
rows = torch.empty(0, dtype=torch.uint8).set_(storage).numpy()[: size // row * row].reshape(-1, row)
order = np.random.default_rng(0).permutation(len(rows))
total = 0
for i in range(0, len(order), 64):
    total += int(rows[np.sort(order[i:i + 64])][:, ::512].sum())
print(time.perf_counter() - t0)
"""


def _place_fill(where: str, folder: Path, size: int, row: int) -> tuple[float, float | None]:
    """Seconds to reserve, map and fill ``size`` bytes in ``where``; seconds a new process takes to
    read the file back (None for anonymous memory)."""
    import numpy as np
    import torch

    from autotune.pretransform.stores import populate, shared_empty

    block = np.random.default_rng(0).integers(0, 255, (64, row), dtype=np.uint8)
    path = folder / f"place-{where.split()[0].strip('/').replace('/', '-')}"
    t0 = time.perf_counter()
    if where == "anonymous":
        data = shared_empty(size, torch.uint8)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        os.posix_fallocate(fd, 0, size)
        data = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared_fd_cpu(fd, size))
        os.close(fd)
    populate(data)
    rows = data.numpy()[: size // row * row].reshape(-1, row)
    for i in range(0, len(rows), 64):
        rows[i : i + 64] = block[: len(rows[i : i + 64])]
    filled = time.perf_counter() - t0
    del rows, data
    if where == "anonymous":
        return filled, None
    out = subprocess.run([sys.executable, "-c", PLACE_CHILD, str(path), str(size), str(row)],
                         capture_output=True, text=True, check=True)
    path.unlink()
    return filled, float(out.stdout)


def places(n: int, rounds: int) -> dict[str, Any]:
    from autotune.pretransform import node

    row = 3 * 32 * 32 * 4  # a CIFAR image through ToTensor and Normalize
    size = n * row
    env = _fresh()
    shm_folder, disk_folder = node.folders(env["AUTOTUNE_CACHE_DIR"])
    fill: dict[str, list[float]] = {"/dev/shm file": [], "anonymous": [], "disk file": []}
    read: dict[str, list[float]] = {"/dev/shm file": [], "disk file": []}
    try:
        for folder in (shm_folder, disk_folder):
            folder.mkdir(parents=True, exist_ok=True)
        for r in range(rounds):
            for where in rotated(list(fill), r):
                folder = disk_folder if where == "disk file" else shm_folder
                f, rd = _place_fill(where, folder, size, row)
                fill[where].append(f)
                if rd is not None:
                    read[where].append(rd)
    finally:
        shutil.rmtree(shm_folder, ignore_errors=True)
        _clear(env)
    med = {k: statistics.median(v) for k, v in fill.items()}
    print("  fill " + ", ".join(f"{k} {v:.2f} s" for k, v in med.items()), flush=True)
    return {"bytes": size, "fill_s": fill, "read_s": read, "fill_median_s": med,
            "read_median_s": {k: statistics.median(v) for k, v in read.items()}}


def write_markdown(summary: dict[str, Any], path: Path) -> None:
    sp, row, rk, kl = summary["second"], summary["in_a_row"], summary["ranks"], summary["killed"]
    mib = 2**20
    lines = [
        "# The node cache: the next process and the other ranks start from what is cached",
        "",
        f"Run on {summary['date']} with `{summary['command']}` on {summary['machine']}; load average"
        f" (1, 5, 15 min) before: {summary['load_before']}, after: {summary['load_after']}."
        " See NOTE [ Node benchmark protocol ] in `benchmarks/scripts/node.py`.",
        "",
        f"The loop: CIFAR10Like({summary['n']}) with the standard training transform, the drop-in with"
        f" nothing written, batch 64, {summary['epochs']} epochs, each run a new process.",
        "",
        "## A second process",
        "",
        f"- With the node cache, a second process's first epoch took **{sp['second_first_vs_settled']:.2f}x**"
        f" its later epochs (median of {len(sp['rounds'])} rounds: {sp['second_first_s']:.2f} s against"
        f" {sp['settled_s']:.2f} s).",
        "- With it off (each process fills its own cache, as before):"
        f" {sp['second_first_vs_settled_off']:.2f}x"
        f" ({sp['second_first_off_s']:.2f} s).",
        "",
        "| round | run 1 (from nothing) | run 2, node cache | run 2, off |",
        "|---|---|---|---|",
        *(f"| {k + 1} | {_secs(r['run1'])} | {_secs(r['run2_node'])} | {_secs(r['run2_off'])} |"
          for k, r in enumerate(sp["rounds"])),
        "",
        "Seconds per epoch.",
        "",
        f"## {len(row['dropin_s'])} runs in a row",
        "",
        f"The drop-in's runs took {row['total_ratio']:.2f}x the plain runs' wall time in all (each run a new"
        " process, start-up included; the first run explores).",
        "",
        "| run | drop-in s | torch s | ratio |",
        "|---|---:|---:|---:|",
        *(f"| {k + 1} | {d:.1f} | {p:.1f} | {d / p:.2f}x |"
          for k, (d, p) in enumerate(zip(row["dropin_s"], row["torch_s"], strict=True))),
        "",
        "## Two ranks under torchrun",
        "",
        "Each rank's drop-in with `pretransform=\"ram\"` over its DistributedSampler shard.",
        "",
        "| | node cache | off |",
        "|---|---:|---:|",
        f"| PSS of both ranks after the last epoch | {rk['node']['pss_total'] / mib:.0f} MiB |"
        f" {rk['off']['pss_total'] / mib:.0f} MiB |",
        f"| USS of both ranks | {rk['node']['uss_total'] / mib:.0f} MiB |"
        f" {rk['off']['uss_total'] / mib:.0f} MiB |",
        "| node caches on the node |"
        f" {', '.join(f'{b / mib:.0f} MiB' for b in rk['node']['ranks'][0]['node_bytes'])}"
        f" | {len(rk['off']['ranks'][0]['node_bytes'])} |",
        *(f"| rank {k} epochs (s) | {_secs(rk['node']['ranks'][k]['epochs'])} |"
          f" {_secs(rk['off']['ranks'][k]['epochs'])} |" for k in (0, 1)),
        "| the node cache filled after each epoch |"
        f" {'; '.join(str(f) for f in rk['node']['ranks'][0]['fills'])} | - |",
        "",
        "The epoch times include the drop-in's own search, which differs between the arms: with the"
        " node cache it measures the filled cache from the second epoch, without it each rank still"
        " fills the shards it had not loaded.",
        "",
        "## A fill killed with SIGKILL",
        "",
        f"Killed after its first batches, the cache held {kl['rerun']['before'][0]} of"
        f" {kl['rerun']['before'][1]} samples. The rerun's batches equal torch's:"
        f" **{kl['rerun']['same_as_torch']}**; it left"
        f" {kl['rerun']['after'][0]} of {kl['rerun']['after'][1]}; a third run found"
        f" {kl['third']['before'][0]} and equals torch's too: {kl['third']['same_as_torch']}.",
        "",
    ]
    if "places" in summary:
        pl = summary["places"]
        anon = pl["fill_median_s"]["anonymous"]
        lines += [
            "## Where a cache lives",
            "",
            f"A cache of {pl['bytes'] / mib:.0f} MiB (CIFAR10Like({summary['place_n']}) through ToTensor and"
            " Normalize) reserved, mapped and filled row block by row block; then read back in random"
            " row blocks by a new process. Medians of the rounds, seconds.",
            "",
            "| where | fill | against anonymous shared memory | read by a new process |",
            "|---|---:|---:|---:|",
            *(f"| {k} | {v:.2f} | {v / anon:.2f}x | "
              f"{pl['read_median_s'][k]:.2f} |" if k in pl["read_median_s"] else
              f"| {k} | {v:.2f} | {v / anon:.2f}x | - |" for k, v in pl["fill_median_s"].items()),
            "",
        ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        mode, rest = argv[1], argv[2:]
        if mode == "loop":
            print(json.dumps(_loop(int(rest[0]), int(rest[1]), rest[2] == "torch")))
        elif mode == "kill":
            print(json.dumps(_kill_child(int(rest[0]), rest[1])))
        else:
            _rank_child(int(rest[0]), int(rest[1]), rest[2])
        return 0
    parser = argparse.ArgumentParser(prog="python benchmarks/scripts/node.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--place-n", type=int, default=None,
                        help="samples of the cache the places are compared with (default 50000)")
    parser.add_argument("--quick", action="store_true", help="a smoke run into a temporary folder")
    parser.add_argument("--out", type=Path, default=None)
    harness.add_render(parser, "NODE.md")
    args = parser.parse_args(argv)
    if harness.render(args, "NODE.md", write_markdown):
        return 0
    harness.fill_in(args, {"n": 1024, "epochs": 3, "rounds": 1, "runs": 2, "place_n": 2048},
                    {"n": 10_000, "epochs": 5, "rounds": 5, "runs": 5, "place_n": 50_000})
    harness.require_positive(parser, args, "n", "rounds", "runs", "place_n")
    if args.epochs < 2:
        parser.error(f"--epochs={args.epochs} must be at least 2: the first epoch is compared with the"
                     " later ones")
    out = harness.out_folder(args, __file__, "autotune-node-")
    summary: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "command": shlex.join(["python", "benchmarks/scripts/node.py", *argv]),
                               "machine": harness.describe_machine(), "n": args.n, "epochs": args.epochs,
                               "load_before": harness.load_average()}
    print("a second process:", flush=True)
    summary["second"] = second_process(args.n, args.epochs, args.rounds)
    print("runs in a row:", flush=True)
    summary["in_a_row"] = in_a_row(args.n, args.epochs, args.runs)
    print("two ranks:", flush=True)
    summary["ranks"] = ranks(args.n, args.epochs)
    print("a fill killed with SIGKILL:", flush=True)
    summary["killed"] = killed(args.n)
    print("where a cache lives:", flush=True)
    summary["places"] = places(args.place_n, args.rounds)
    summary["place_n"] = args.place_n
    summary["load_after"] = harness.load_average()
    out.mkdir(parents=True, exist_ok=True)
    (out / "node.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_markdown(summary, out / "NODE.md")
    print(f"wrote {out / 'NODE.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
