"""One replica of a fault-tolerant job on torchft: DiLoCo or DDP through fastcomm.ft (docs/ft.md).

Start one Lighthouse, then one ``torchrun`` per replica group (each its own rendezvous); kill any replica
and the others go on; ``--max-restarts`` starts it again and it heals from a peer::

    torchft_lighthouse --bind 127.0.0.1:29510 --min_replicas 2 --join_timeout_ms 10000 &
    for r in 0 1 2; do
      TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510 torchrun --nproc-per-node 1 --master-port $((29600 + r)) \\
          --max-restarts 5 examples/ft_train.py --replica-id $r --method diloco --steps 300 &
    done

The data is a synthetic regression (``--data``, written once by whichever replica comes first): each
replica reads its share of one order, split again at every quorum, so no sample is lost or read twice.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import fastcomm
import fastcomm.ft
import fastio


def write_data(path: Path, samples: int) -> None:
    """``samples`` rows ``x -> x W + noise`` (16 -> 8), unless ``path`` holds them already."""
    if path.exists():
        return
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((16, 8)).astype(np.float32)
    partial = path.with_name(f"{path.name}.partial.{os.getpid()}")
    with fastio.ShardWriter(str(partial), max_samples=1000) as writer:
        for _ in range(samples):
            x = rng.standard_normal(16).astype(np.float32)
            writer.write({"x": x, "y": x @ weights + 0.1 * rng.standard_normal(8).astype(np.float32)})
    try:
        partial.rename(path)  # another replica may have been first: then its data is used
    except OSError:
        pass


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--replica-id", required=True, help="this replica group's id, unique in the job")
    parser.add_argument("--method", choices=("diloco", "ddp"), default="diloco")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--sync-every", type=int, default=10, help="DiLoCo's H")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--data", default="ft_data")
    parser.add_argument("--host", default="127.0.0.1", help="the address this replica advertises")
    args = parser.parse_args()

    torch.manual_seed(0)  # every replica starts alike (the first quorum heals them from one anyway)
    write_data(Path(args.data), 100_000)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    manager = fastcomm.ft.connect(
        f"replica{args.replica_id}", min_replicas=args.min_replicas, host=args.host,
        rank=int(os.environ.get("RANK", 0)), world_size=int(os.environ.get("WORLD_SIZE", 1)),
        timeout=timedelta(seconds=30), quorum_timeout=timedelta(seconds=300),
    )  # fmt: skip
    data = fastcomm.ft.ReplicaData(lambda rank, world: fastio.StreamLoader(
        args.data, batch_size=args.batch_size, shuffle=True, seed=0,
        order=fastio.OrderOptions(rank=rank, world_size=world)))  # fmt: skip
    loss_of = lambda batch: torch.nn.functional.mse_loss(model(batch["x"]), batch["y"])  # noqa: E731
    begin = time.time()
    if args.method == "diloco":
        outer = fastcomm.DiLoCo(model, inner, sync_every=args.sync_every, outer_lr=0.7, outer_momentum=0.5,
                                compressor="quantize", bits=4)  # fmt: skip
        ft = fastcomm.ft.FaultTolerantDiLoCo(manager, outer, data=data)
        fastcomm.ft.heal_state(manager, model=model, inner=inner, outer=ft, data=data)
        ft.start()
        while outer.inner_steps < args.steps:
            loss = loss_of(data.next())
            loss.backward()
            ft.step()
            inner.zero_grad()
            if outer.inner_steps % args.sync_every == 0:
                print(f"step {outer.inner_steps} loss {loss.item():.4f} replicas "
                      f"{manager.num_participants()} failed syncs {ft.failed_syncs}", flush=True)  # fmt: skip
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # DDP's own, one rank
        ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
        hook = fastcomm.ft.register(ddp, manager, "quantize", bits=8)
        fastcomm.ft.heal_state(manager, model=model, inner=inner, hook=hook, data=data)
        while manager.current_step() < args.steps:
            manager.start_quorum()
            data.split(manager)
            batch = data.next()
            loss = torch.nn.functional.mse_loss(ddp(batch["x"]), batch["y"])
            loss.backward()
            if manager.should_commit():
                inner.step()
                data.commit()
            else:
                data.rollback()  # a peer died inside the exchange: this step's samples are read again
            inner.zero_grad()
            if manager.current_step() % 10 == 0:
                print(f"step {manager.current_step()} loss {loss.item():.4f} replicas "
                      f"{manager.num_participants()}", flush=True)  # fmt: skip
    print(f"replica {args.replica_id}: {args.steps} steps in {time.time() - begin:.1f} s", flush=True)
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's server threads would keep the process alive


if __name__ == "__main__":
    main()
