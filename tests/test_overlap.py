"""Communication overlapped with compute: the benchmark's smoke mode and what mt3d.ds.overlap relies on
in the pinned DeepSpeed's source (the parity runs are in test_training.py)."""

import inspect

import pytest
from test_bench import bench


def test_overlap_benchmark_hides_transfers_and_posts_buckets_in_the_backward():
    """The smoke mode measures the TP, DP, PP and EP rows; with buckets smaller than the model, buckets
    are posted while the last backward still runs (every one of them: the last fills when the
    backward ends)."""
    rec, text = bench("overlap", "--smoke", "--reps", "2", "--bucket-elements", "60000")
    assert [row["sp"] for row in rec["rows"]] == [True, False]  # the re-gathered and the all-reduced path
    for row in rec["rows"]:
        assert row["comm_ms"] > 0 and row["gemms_ms"] > 0 and 0 < row["predicted"] <= 1
    dp = rec["dp"]
    assert dp["buckets"] > 2 and dp["posted_in_backward"] == dp["buckets"], dp
    assert dp["comm_ms"] > 0 and dp["last_backward_ms"] > 0 and 0 < dp["predicted"] <= 1
    assert "data-parallel gradient reduction at dp 2" in text
    # pp 2, m = 4: waiting is measured both ways on each stage, beside the simulated schedule's saving
    assert [r["stage"] for r in rec["pp"]] == [0, 1] and all(0 < r["predicted"] <= 1 for r in rec["pp"])
    assert all(r["wait_ms"] > 0 and r["async_wait_ms"] >= 0 and r["step_ms"] > 0 for r in rec["pp"])
    # ep 2: a MoE layer's all-to-all in 1, 2 and 4 chunks, blocked time measured pipelined and serial,
    # beside the planner's min(1 - 1/n, compute / comm)
    assert [r["chunks"] for r in rec["ep"]] == [1, 2, 4]
    for r in rec["ep"]:
        assert r["comm_ms"] > 0 and r["compute_ms"] > 0 and r["blocked_ms"] >= 0, r
        cap = min(1 - 1 / r["chunks"], r["compute_ms"] / r["comm_ms"])
        assert r["predicted"] == pytest.approx(cap), r
    assert "hidden behind the routed experts" in text


def test_deepspeed_still_needs_what_mt3d_ds_overlap_does():
    """The pipeline engine declares a gradient-accumulation boundary only inside its reduce step (so
    ZeRO-1's hooks never reduce during a backward) and dispatches instructions through a table looked
    up on the instance; ZeRO-1's reduction communicates in average_tensor (the fallback without
    contiguous gradients in buffered_reduce_fallback); the BF16 optimizer's immediate update fills
    its fp32 gradients from post-accumulate-grad hooks, which run in registration order."""
    from deepspeed.runtime import bf16_optimizer
    from deepspeed.runtime.pipe import engine as pipe_engine
    from deepspeed.runtime.zero import stage_1_and_2

    pe = pipe_engine.PipelineEngine
    assert "return self._force_grad_boundary" in inspect.getsource(pe.is_gradient_accumulation_boundary)
    assert "self._INSTRUCTION_MAP[type(cmd)]" in inspect.getsource(pe._exec_schedule)
    z = stage_1_and_2.DeepSpeedZeroOptimizer
    ready = inspect.getsource(z.reduce_ready_partitions_and_remove_grads)
    assert "self.is_gradient_accumulation_boundary()" in ready
    ipg = inspect.getsource(z.reduce_ipg_grads)
    assert "self.average_tensor(" in ipg and "self.buffered_reduce_fallback(" in ipg
    hooks = inspect.getsource(bf16_optimizer.BF16_Optimizer.create_grad_acc_hooks)
    assert "register_grad_hook" in hooks and "accumulate_hp_grads_and_remove_lp" in hooks
    from deepspeed.utils.torch import register_grad_hook

    assert "register_post_accumulate_grad_hook" in inspect.getsource(register_grad_hook)
