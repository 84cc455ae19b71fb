"""ParallelState against DeepSpeed's own grid, and the spawn harness's failure handling."""

import os
import time

import pytest
import torch

from mt3d.parallel.spawn import WorkerError, spawn
from mt3d.parallel.state import ParallelState


def state_worker(tp, pp, gpn):
    import torch.distributed as dist
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid

    from mt3d.ds.topology import map_ranks

    topo = map_ranks(dist.get_world_size(), tp, pp, gpus_per_node=gpn)
    st = ParallelState.build(topo)
    grid = PipelineParallelGrid(topology=topo)
    # an all-reduce over each of our groups sums exactly the listed members' ranks
    sums = {}
    for name in ("tp", "dp", "pp", "model"):
        g = getattr(st, name)
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t, group=g.group)
        sums[name] = (t.item(), float(sum(g.ranks)))
    t = torch.tensor([1.0])
    dist.all_reduce(t, group=st.get_tensor_model_parallel_group())
    return dict(
        sums=sums,
        tp_group_sum=t.item(),
        ours=(
            st.get_tensor_model_parallel_rank(),
            st.get_tensor_model_parallel_world_size(),
            st.get_data_parallel_rank(),
            st.get_data_parallel_world_size(),
            st.get_pipe_parallel_rank(),
            st.get_pipe_parallel_world_size(),
            st.get_model_parallel_world_size(),
            sorted(st.get_data_parallel_group_ranks()),
        ),
        deepspeed=(
            grid.get_slice_parallel_rank(),
            grid.get_slice_parallel_world_size(),
            grid.get_data_parallel_rank(),
            grid.get_data_parallel_world_size(),
            grid.get_pipe_parallel_rank(),
            grid.get_pipe_parallel_world_size(),
            grid.get_model_parallel_world_size(),
            sorted(grid.get_data_parallel_group_ranks()),
        ),
        coord=topo.coord(dist.get_rank()),
        st=(st.tp.rank, st.dp.rank, st.pp.rank),
    )


@pytest.mark.parametrize("tp,pp,gpn", [(2, 2, 8), (2, 2, 4), (1, 4, 8), (4, 1, 8)])
def test_parallel_state_agrees_with_deepspeed_grid(tp, pp, gpn):
    for res in spawn(state_worker, 8, tp, pp, gpn, timeout=180):
        assert res["ours"] == res["deepspeed"]
        for name, (got, want) in res["sums"].items():
            assert got == want, name
        assert res["tp_group_sum"] == tp
        assert res["st"] == (res["coord"]["tp"], res["coord"]["dp"], res["coord"]["pp"])


def test_single_state_needs_no_processes():
    st = ParallelState.single()
    assert (st.tp.size, st.dp.size, st.pp.size) == (1, 1, 1)
    assert st.is_first_stage and st.is_last_stage and st.tp.group is None


def failing_worker():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()  # rank 0 waits here for a rank that will never come


def crashing_worker():
    import torch.distributed as dist

    if dist.get_rank() == 0:
        os._exit(3)
    dist.barrier()


def sleeping_worker():
    time.sleep(60)


def test_a_failing_rank_fails_the_run_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1 failed") as info:
        spawn(failing_worker, 2, timeout=60)
    assert "boom on rank one" in str(info.value) and "ValueError" in str(info.value)
    assert time.monotonic() - t0 < 30


def test_a_crashed_rank_is_reported():
    with pytest.raises(WorkerError, match="exited with code 3"):
        spawn(crashing_worker, 2, timeout=60)


def test_timeout_kills_the_run():
    t0 = time.monotonic()
    with pytest.raises(WorkerError, match="timed out"):
        spawn(sleeping_worker, 2, timeout=3)
    assert time.monotonic() - t0 < 20
