"""Run a function on R local gloo ranks in spawned processes, under a hard timeout.

Used by the tests and benchmarks of the context-parallel core on CPU: a collective mismatch
between ranks makes a rank block forever, so the parent kills every rank when the time is
up and raises, instead of hanging.
"""

from __future__ import annotations

import os
import pickle
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn: Callable, args: tuple, env: dict[str, str], queue) -> None:
    os.environ.update(env)
    # the ranks share the machine's cores: more threads than cores makes each rank's OpenMP threads spin on cores
    # another rank needs (a 2-rank tree walk on 2 cores: over 150 s with torch's default 2 threads each, under 1 s
    # with one)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        result = fn(rank, world, *args)
        queue.put((rank, "ok", pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 300.0, env: dict[str, str] | None = None
) -> list[Any]:
    """``[fn(rank, world, *args) for rank in range(world)]``, each in its own process with gloo initialised.

    ``fn`` must be importable (a module-level function); its return value must pickle. Raises
    RuntimeError with every failing rank's traceback, or TimeoutError (all ranks killed) when
    the ranks have not all finished within ``timeout_s``. ``env`` is set in each rank before
    the process group starts (e.g. ``TORCH_DISTRIBUTED_DEBUG=DETAIL``). Each rank takes cores / R torch threads
    (at least one).
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, world, port, fn, args, dict(env or {}), queue), daemon=True)
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        while len(results) < world:
            try:
                rank, status, payload = queue.get(timeout=timeout_s)
            except Exception as exc:  # queue.Empty: some rank is stuck (likely a collective mismatch)
                missing = sorted(set(range(world)) - set(results))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s") from exc
            results[rank] = (status, payload)
            if status == "error":
                break  # the others may now block in a collective; stop them
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(results) == world else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [f"rank {rank}:\n{payload}" for rank, (status, payload) in sorted(results.items()) if status == "error"]
    if errors:
        raise RuntimeError("\n".join(errors))
    return [pickle.loads(results[rank][1]) for rank in range(world)]
