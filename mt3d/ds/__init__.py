"""DeepSpeed behind one door: every subclass, override and patch of DeepSpeed's internals, and every
workaround of its bugs, lives in this package; the rest of mt3d uses DeepSpeed's public API or this
package (tests/test_deepspeed_door.py lists any reach outside it). A DeepSpeed upgrade is this
folder's work: each reach below names the test that fails when upstream changes under it.

The pinned DeepSpeed version lives in one place, the package's requirement in setup.cfg;
``pinned_version`` reads it back from the installed metadata and messages name the running one.

Each reach, why it exists and the test that watches it are listed in ``REACHES``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..versions import pinned_version, running_version  # noqa: F401 - the door names them too


@dataclass(frozen=True)
class Reach:
    """One place mt3d reaches into DeepSpeed's internals or works around its behaviour."""

    module: str
    """The module of this package that holds it."""
    what: str
    """What is overridden, patched or worked around, and why."""
    watch: str
    """The test (``file::name``) that fails when DeepSpeed changes under it."""


REACHES = (
    Reach("topology", "ProcessTopology with a rewritten mapping: the rank mapper's placement as its grid",
          "test_topology.py::test_default_order_reproduces_deepspeed"),
    Reach("pipe", "PipelineModule._partition_layers/_build/_set_bounds/_synchronize_tied_weights overridden: "
          "stages by block counts, chunks of virtual stages, the tied broadcast without autograd",
          "test_interleaved.py::test_every_interleaved_layout_matches_one_process"),
    Reach("interleaved", "PipelineEngine's instruction handlers overridden, deepspeed.PipelineEngine "
          "swapped during deepspeed.initialize: the interleaved schedule (also at v 1 with overlap.p2p: "
          "commits posted without waiting)",
          "test_interleaved.py::test_every_interleaved_layout_matches_one_process"),
    Reach("interleaved", "a WeightPass instruction added to PipelineEngine's map, each backward run inside "
          "parallel.deferred: zero-bubble ZB-H1 with W after B, its gradients through DeepSpeed's hooks",
          "test_zero_bubble.py::test_zb_h1_trains_as_one_process_in_fp32_and_as_1f1b_in_bf16_and_resumes_under_1f1b"),
    Reach("interleaved", "ZB-V's V: is_first_stage/is_last_stage by the placement (DeepSpeed's start-up "
          "handshake still sees stages 0 and p-1), _loss_stage_global_rank on rank 0, LocalActivation and "
          "LocalGrad instructions, _send/_recv_tensor_meta once per peer",
          "test_zero_bubble.py::test_zbv_trains_as_one_process_with_the_v_placement_and_resumes_under_zb_h1"),
    Reach("engine", "FusedAdam's builder breaks on arch suffixes: torch's AdamW is asked for",
          "test_checkpoint.py::test_deepspeed_fused_adam_builder_still_breaks_on_arch_suffixes"),
    Reach("engine", "fp32 without ZeRO: opt.step, clip_fp32_gradients and _global_grad_norm patched (a "
          "kept norm, non-finite steps skipped)",
          "test_checkpoint.py::test_nan_steps_are_skipped_without_zero_too"),
    Reach("engine", "the checkpoint engine unpickles with weights_only=False: wrapped by the safe loader",
          "test_checkpoint.py::test_deepspeed_workarounds_are_still_needed"),
    Reach("optim_states", "DeepSpeedCPUAdam cannot load torch AdamW's state: a load pre-hook fills it in",
          "test_offload.py::test_cpu_adam_takes_torch_adamw_state_only_through_the_workaround"),
    Reach("nvme", "NVMe-offloaded ZeRO-3 states resume inexactly: mt3d restores what DeepSpeed leaves out",
          "test_offload.py::test_nvme_resume_is_exact_with_another_scheduler_at_dp2"),
    Reach("universal", "reshards of ZeRO-3 states DeepSpeed gets wrong: refused up front",
          "test_checkpoint.py::test_zero3_checkpoints_export_and_refuse_what_deepspeed_reshards_wrongly"),
    Reach("experts", "ep ranks in DeepSpeed's 'model' axis, without ZeRO: engine.allreduce_gradients/"
          "_bf16_reduce_grads wrapped (dense gradients over ep), dense weights marked ds_pipe_replicated "
          "on ep ranks > 0", "test_moe.py::test_moe_training_matches_one_process"),
    Reach("experts", "with ZeRO: the engine module's DeepSpeedZeroOptimizer swapped during initialize (its "
          "MoE groups over mt3d's dense and edp groups, mt3d's state as its mpu), "
          "_do_optimizer_sanity_check's BF16 answer turned into ZeRO, _broadcast_model replaced (experts "
          "over their own ranks), every rank's save_zero_checkpoint set and its zero file names listed up to "
          "dp x cp; scaled_global_norm overridden (all groups' squares reduced at once)",
          "test_moe.py::test_zero_partitions_dense_states_over_every_data_rank_and_experts_over_theirs"),
    Reach("universal", "DeepSpeed's universal loader pairs parameter groups by position (zip): the "
          "checkpoint's group settings padded to mt3d's four slots",
          "test_moe.py::test_moe_checkpoints_resume_exactly_and_reshard"),
    Reach("experts", "the grid's slice rank/size answered with tp during a universal load (DeepSpeed "
          "slices by its whole 'model' axis)",
          "test_moe.py::test_moe_checkpoints_resume_exactly_and_reshard"),
    Reach("experts", "what each of the above relies on in DeepSpeed's source",
          "test_moe.py::test_deepspeed_still_needs_what_mt3d_ds_experts_does"),
    Reach("engine", "clip_grad_norm_ ignores ds_pipe_replicated: the fp32 guard computes the norm from the "
          "counted weights", "test_moe.py::test_moe_training_matches_one_process"),
    Reach("universal", "ds_to_universal takes tp x ep model ranks for TP slices: each ep rank's files "
          "converted as a tp-only checkpoint (links, rewritten model-state sizes and patterns), then joined",
          "test_moe.py::test_moe_checkpoints_resume_exactly_and_reshard"),
    Reach("overlap", "data-parallel gradient reduction during the last backward: the engine's instruction "
          "table copied per instance (backward and tied reduction wrapped), its reduction skipped or run "
          "with ZeRO-1's average_tensor a no-op, bf16.immediate_grad_update set",
          "test_overlap.py::test_deepspeed_still_needs_what_mt3d_ds_overlap_does"),
    Reach("engine", "the pipeline engine's last stage keeps its logits until a buffer is reused (its "
          "backward returns early): dropped once the loss is computed (the instance's instruction table)",
          "test_training.py::test_the_last_stage_releases_its_logits_once_the_loss_holds_them"),
    Reach("engine", "ZeRO-1 with one data rank: contiguous_gradients off and buffered_reduce_fallback a "
          "no-op (DeepSpeed copies every gradient into a bucket and back to reduce it over one rank); "
          "has_overflow answered by the norm, get_grad_norm_direct's L2 norm as one foreach fp64 norm",
          "test_training.py::test_one_data_rank_skips_deepspeeds_reduction_with_the_same_step"),
    Reach("ops", "a JIT op build's stale lock makes every later run wait forever: named with its fix",
          "test_offload.py::test_torch_still_waits_on_build_locks_without_a_time_limit"),
)  # fmt: skip
"""Every reach into DeepSpeed, with the test that watches it (tests/test_deepspeed_door.py checks they
exist)."""
