"""Per-process set-up of a run: threads, torch.distributed, hosts, topology, ParallelState, RNG.

Hosts are discovered from what the launcher did (each rank's LOCAL_RANK and host name, gathered
once), so the deepspeed launcher, torchrun and multi-node hostfiles all give the right layout,
uneven nodes included. A hostfile in the config overrides the discovery.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass

import torch

from ..config import ParallelConfig
from ..config.rules import dispatch_hosts_conflict, order_conflict
from ..ds.topology import MappedTopology, map_ranks
from ..errors import UserError
from ..inputs import env_int
from ..parallel.hosts import Host, TopologyError, parse_islands, read_hostfile
from ..parallel.random import RNGTracker, seed_everything
from ..parallel.spawn import free_port
from ..parallel.state import ParallelState

log = logging.getLogger("mt3d")


@dataclass
class Runtime:
    """What one rank knows about the job once process groups exist."""

    rank: int
    local_rank: int
    world: int
    device: torch.device
    topology: MappedTopology
    state: ParallelState
    tracker: RNGTracker


def set_threads() -> int:
    """torch threads = cores / ranks on this host, unless OMP_NUM_THREADS says otherwise."""
    if os.environ.get("OMP_NUM_THREADS"):
        n = max(1, env_int("OMP_NUM_THREADS", 1, minimum=1))
    else:
        local = env_int("LOCAL_WORLD_SIZE", None, minimum=1) or env_int("LOCAL_SIZE", 1, minimum=1)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        n = max(1, cores // max(1, local))
    torch.set_num_threads(n)
    return n


def init_distributed() -> tuple[int, int, int]:
    """Initialise DeepSpeed's communication (NCCL on GPU, gloo on CPU); (rank, local_rank, world)."""
    import deepspeed

    if "RANK" not in os.environ:  # plain `python -m mt3d.train`: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    local_rank = env_int("LOCAL_RANK", 0)
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    import torch.distributed as dist

    try:
        deepspeed.init_distributed(verbose=False)
    except dist.DistNetworkError as e:
        if "EADDRINUSE" not in str(e) and "address already in use" not in str(e).lower():
            raise
        port, addr = os.environ.get("MASTER_PORT"), os.environ.get("MASTER_ADDR")
        raise UserError(
            f"MASTER_PORT {port} on {addr} is already in use (another job?); pick another: "
            "deepspeed --master_port N, torchrun --master-port N, accelerate launch --main_process_port N, "
            "or MASTER_PORT=N"
        ) from None

    return dist.get_rank(), local_rank, dist.get_world_size()


def discover_hosts() -> tuple[Host, ...]:
    """Hosts in rank order, from every rank's (host name, LOCAL_RANK): a new host starts at local rank 0."""
    import torch.distributed as dist

    mine = (socket.gethostname(), int(os.environ.get("LOCAL_RANK", 0)))
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    hosts: list[list] = []
    for name, local in everyone:
        if local == 0 or not hosts:
            hosts.append([name, 0])
        hosts[-1][1] += 1
    names = [n for n, _ in hosts]
    if len(set(names)) != len(names):  # several launchers on one machine (simulated nodes)
        names = [f"{n}#{i}" for i, n in enumerate(names)]
    return tuple(Host(n, s) for n, (_, s) in zip(names, hosts))


def setup(par: ParallelConfig, seed: int) -> Runtime:
    """Threads, process groups, rank mapping and RNG for this rank, from the run's parallel section."""
    set_threads()
    rank, local_rank, world = init_distributed()
    hosts = read_hostfile(par.hostfile) if par.hostfile else discover_hosts()
    topo = map_ranks(
        world,
        hosts=hosts,
        order=par.order,
        islands=parse_islands(par.islands) if par.islands else None,
        allow_crossing=par.allow_crossing,
        expert_tensor=par.expert_tensor,
        **par.degrees(),
    )
    why = dispatch_hosts_conflict(par.expert_dispatch, topo.placement) or order_conflict(topo.placement)
    if why:
        raise TopologyError(why)
    state = ParallelState.build(topo)
    # Same default stream on every TP and DP rank of a stage (replicated dropout matches across TP);
    # stages, and cp ranks (which hold other tokens), differ so they do not repeat each other's masks.
    stream = seed + 100 * state.pp.rank + 1_000_003 * state.cp.rank
    seed_everything(stream)
    tracker = RNGTracker.for_tp(stream, state.tp)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if rank == 0:
        pl = topo.placement
        log.info(
            "layout: world %d = %s, %d host(s), groups crossing hosts %s",
            world,
            " x ".join(f"{ax} {pl.size(ax)}" for ax in pl.axes),
            len(hosts),
            {ax: pl.crossing(ax) for ax in pl.axes},
        )
        if par.expert_dispatch == "node":
            _, hosts, per_host = pl.ep_host_blocks().shape
            one = "" if hosts > 1 else " (one hop: no ep group crosses hosts)"
            log.info("expert dispatch: node, ep groups on %d host(s) x %d rank(s)%s", hosts, per_host, one)
    return Runtime(rank, local_rank, world, device, topo, state, tracker)
