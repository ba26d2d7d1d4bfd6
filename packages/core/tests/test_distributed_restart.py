"""A restarted launch joins its process group on a store that holds the previous attempt's keys.

torchrun's agent hosts one TCP store for the whole job and starts every attempt's ranks
against it (``--max-restarts``). Here the test plays the agent: it hosts the store, runs one
attempt of two ranks to the end, then restarted attempts whose rank 1 starts late. Without a
fresh prefix per attempt, a restarted attempt's rank 0 reads rank 1's address from an earlier
attempt and its gloo connect fails ("Connection refused") or waits out the timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from longboat.core.distributed import destroy_distributed, init_distributed
from longboat.core.distributed.init import join_launch, launch_store_prefix

INIT_TIMEOUT_S = 20.0
RESTARTS = 4
"""Restarted attempts: on a shared store without a fresh prefix, about half of them fail (which
side of a gloo pair connects depends on the order of the two addresses, one of them stale)."""


def _rank(env: dict[str, str], delay_s: float, results: Any) -> None:
    """One rank as torchrun's agent starts it: join, all-reduce, leave; report to ``results``."""
    os.environ.update(env)
    rank = int(env["RANK"])
    torch.set_num_threads(1)  # no OpenMP pool in a forked child
    try:
        time.sleep(delay_s)
        info = init_distributed(timeout=INIT_TIMEOUT_S)
        t = torch.tensor([float(info.rank + 1)])
        dist.all_reduce(t)
        results.put((rank, t.item(), launch_store_prefix()))
        destroy_distributed()
    except BaseException as exc:  # reported, not raised: the parent asserts
        results.put((rank, f"{type(exc).__name__}: {exc}", None))
    finally:
        os._exit(0)


def _attempt(port: int, restart_counts: tuple[int, int], delays: tuple[float, float]) -> list:
    """Two ranks against the store at ``port`` (forked: no interpreter start-up), as torchrun's
    agent starts an attempt; each rank's (rank, all-reduce sum or error, store prefix)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    procs = []
    for rank in range(2):
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RESTART_COUNT": str(restart_counts[rank]),
            "TORCHELASTIC_RUN_ID": "restart-test",
        }
        procs.append(ctx.Process(target=_rank, args=(env, delays[rank], results)))
        procs[-1].start()
    out = []
    for _ in procs:
        try:
            out.append(results.get(timeout=INIT_TIMEOUT_S + 30))
        except queue.Empty:
            out.append((None, "no answer (hung)", None))
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join()
    return sorted(out, key=lambda r: (r[0] is None, r[0] or 0))


def _agent(port: Any, stop: Any) -> None:
    """The job's store, hosted as torchrun's agent hosts it (in a process of its own, so that
    the test forks its ranks from a process without the store's threads)."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )
    port.put(store.port)
    stop.wait(300)


@pytest.mark.multiprocess
@pytest.mark.skipif(sys.platform != "linux", reason="forks the ranks")
def test_restarted_attempts_never_read_an_earlier_attempts_keys() -> None:
    ctx = mp.get_context("fork")
    port, stop = ctx.Queue(), ctx.Event()
    agent = ctx.Process(target=_agent, args=(port, stop), daemon=True)
    agent.start()
    try:
        store_port = port.get(timeout=60)
        prefixes = []
        for attempt in range(1 + RESTARTS):
            # From the first restart on, rank 1 starts late (a slow node): rank 0 connects
            # while only earlier attempts' keys are there. Rank 1's agent counts its restarts
            # from 0 (a replaced node), rank 0's from the attempt.
            done = _attempt(store_port, (attempt, 0), (0.0, 0.0 if attempt == 0 else 1.5))
            assert [(r, s) for r, s, _ in done] == [(0, 3.0), (1, 3.0)], (attempt, done)
            assert done[0][2] == done[1][2], done  # one prefix for the ranks of an attempt
            prefixes.append(done[0][2])
        assert len(set(prefixes)) == 1 + RESTARTS  # and a new one for each attempt
    finally:
        stop.set()
        agent.join(timeout=10)


def _join(store_port: int, rank: int, world_size: int, out: dict[int, str]) -> None:
    client = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=30))
    out[rank] = join_launch(client, rank, world_size, timedelta(seconds=30))


def test_join_launch_gives_every_rank_one_fresh_prefix_despite_stale_nonces() -> None:
    import threading

    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    # What a failed attempt leaves: nonces of ranks 1..3 that nobody waits on any more.
    for r in range(1, 4):
        store.set(f"longboat/join/ask/{r}", f"stale{r}")
    prefixes: dict[int, str] = {}
    threads = [threading.Thread(target=_join, args=(store.port, r, 4, prefixes)) for r in range(4)]
    threads[0].start()
    time.sleep(0.3)  # rank 0 answers the stale nonces before the others post theirs
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(prefixes) == [0, 1, 2, 3]
    assert len(set(prefixes.values())) == 1
    again: dict[int, str] = {}
    threads = [threading.Thread(target=_join, args=(store.port, r, 4, again)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(set(again.values())) == 1 and set(again.values()) != set(prefixes.values())


def test_join_launch_names_the_ranks_that_never_came() -> None:
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    store.set("longboat/join/ask/1", "stale")  # an earlier attempt's rank 1; rank 2 never
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1, 2\] of 3 did not join"):
        join_launch(store, 0, 3, timedelta(seconds=0.5))
