"""Data-parallel gradient reduction overlapped with the backward of the last micro-batch, inside
DeepSpeed's pipeline engine (ZeRO 0 and 1, fp32 and bf16).

DeepSpeed's pipeline engine reduces gradients in a schedule step of its own (``ReduceGrads``) after
every backward has run, so the whole reduction is exposed. ZeRO-1's ``overlap_comm`` does not change
that there: its gradient hooks reduce only at a gradient-accumulation boundary, which the pipeline
engine declares only while that step runs (``_force_grad_boundary``). So mt3d does it here:

* buckets: the trainable parameters in reverse registration order (the order a backward finishes
  their gradients), cut into buckets of about ``bucket_elements``;
* during the last micro-batch's backward of each chunk (``_exec_backward_pass`` counted per chunk),
  and under a zero-bubble schedule during its last weight pass too (W, where the linears' weight
  gradients are computed: ``interleaved.WeightPass``, counted per chunk alike), a
  post-accumulate-grad hook, registered after DeepSpeed's own, marks a parameter's gradient final;
  a bucket whose gradients are all final is flattened (a copy) and all-reduced asynchronously over
  DeepSpeed's data-parallel group, strictly in bucket order so every rank posts the same sequence
  of collectives;
* before the tied-weight reduction and the gradient reduction, the buckets not posted yet (a
  parameter without a gradient in that micro-batch) are posted, every bucket is waited for, and
  the averages are written back; DeepSpeed's reduction then has nothing left to communicate: it is
  skipped (ZeRO-0, the BF16 optimizer) or runs with its communication (``average_tensor``) made a
  no-op (ZeRO-1: its partition bookkeeping still runs).

Under expert parallelism (ZeRO-1 only: without ZeRO dense gradients take two hops, ``mt3d.ds.experts``)
a bucket holds dense or expert parameters, never both: dense ones are summed over ZeRO's group
(dp x cp), experts' over the ranks holding the same experts (dp / ep x cp; a bucket over one rank is
only scaled), every one divided by dp x cp first, as ZeRO-1's ``average_tensor`` does
(``reduction_groups``).

The tensors reduced are the ones DeepSpeed would reduce: ``p.grad`` (ZeRO-0, and ZeRO-1 with
gradients in the weights' dtype: fp32, or bf16 by default), ZeRO-1's ``grad_accum`` (another
gradient dtype), or the BF16 optimizer's fp32 gradient buffers (bf16 with ``data_types.
grad_accum_dtype`` fp32), which it fills per parameter from a hook when
``bf16.immediate_grad_update`` is on (``deepspeed_config`` sets it). The scaling follows DeepSpeed's
(``allreduce_bucket``: sum, then 1/dp; ZeRO-1's ``average_tensor``: 1/dp, then sum), so at dp 2 the
results are DeepSpeed's to the bit; with weights tied across stages (the embedding and the head) the
tied sum comes after the average instead of before it: last-bit differences. Watched by
tests/test_training.py (parity with the one-process run and with the plain path) and
tests/test_overlap.py (what it relies on in DeepSpeed's source).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe import schedule as ds_schedule

from ..parallel.deferred import waits_for_w
from .instructions import wrap_instructions

log = logging.getLogger("mt3d")


@dataclass
class _Bucket:
    params: list
    group: object = None
    """The process group its gradients are summed over (None: one rank, nothing to sum)."""
    waiting: int = 0
    """Parameters whose gradient is not final yet in this step's last backward."""
    tensors: list = field(default_factory=list)
    flat: torch.Tensor | None = None
    work: object = None


class GradReduceOverlap:
    """The buckets, hooks and waits of one engine (see the module docstring)."""

    def __init__(self, engine, bucket_elements: int, state=None) -> None:
        from .experts import gradient_pairs, is_expert

        self.engine = engine
        opt = engine.optimizer
        self.bf16 = hasattr(opt, "bf16_groups")
        self.zero1 = not self.bf16 and hasattr(opt, "average_tensor")
        groups = reduction_groups(engine, state)
        self.dp = dist.get_world_size(groups[False])
        if self.zero1 and opt.cpu_offload:
            # with offload, ZeRO-1's average_tensor also copies into its CPU partition: the no-op
            # below would drop the gradients (mt3d.config.rules.overlap_conflict refuses offload)
            raise RuntimeError("overlapped gradient reduction does not run with optimizer offload")
        if self.bf16 and not opt.immediate_grad_update:
            raise RuntimeError(
                "overlapped gradient reduction needs bf16.immediate_grad_update (deepspeed_config)"
            )
        self._tensor_of = None if not self.bf16 else {id(p): g for p, g in gradient_pairs(engine)}
        params = [p for p in engine.module.parameters() if p.requires_grad and p.numel() > 0]
        self.buckets: list[_Bucket] = []
        current, size = {}, {}  # per kind (expert or not): the bucket being filled, its elements
        for p in reversed(params):
            kind = is_expert(p) and groups[True] is not groups[False]
            current.setdefault(kind, []).append(p)
            size[kind] = size.get(kind, 0) + p.numel()
            if size[kind] >= bucket_elements:
                self.buckets.append(_Bucket(current.pop(kind), _summed_over(groups[kind])))
                size[kind] = 0
        for kind, rest in current.items():  # every rank of a group holds the same shapes: the same order
            self.buckets.append(_Bucket(rest, _summed_over(groups[kind])))
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._shared = _shared_across_chunks(engine.module)
        """Parameters two of this rank's chunks use (ZB-V's rank 0 holds the first and the last stage: a
        tied embedding), which two passes finish: their buckets wait for ``finish``."""
        self._ready: set[int] = set()
        self.armed = False
        self._logged = False
        self.reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)

    # --- which tensor, which scaling --------------------------------------------------------------
    def _tensor(self, p: torch.Tensor) -> torch.Tensor:
        if self._tensor_of is not None:
            return self._tensor_of[id(p)]
        opt = self.engine.optimizer
        # ZeRO-1 accumulates into ``grad_accum`` when its gradient dtype differs from the weights'
        accum = self.zero1 and opt.use_grad_accum_attribute
        g = getattr(p, "grad_accum", None) if accum else p.grad
        if g is None:  # as DeepSpeed: every rank reduces the same sizes
            g = torch.zeros_like(p, dtype=opt.gradient_accumulation_dtype if accum else p.dtype)
            if accum:
                p.grad_accum = g
            else:
                p.grad = g
        return g

    def _scale(self, flat: torch.Tensor, before: bool) -> None:
        """Scale ``flat`` before or after the sum exactly as DeepSpeed's reduction of this optimizer."""
        e = self.engine
        if self.zero1:  # ZeRO-1's average_tensor: divide by dp, then reduce
            if before and e.optimizer.gradient_average:
                flat.div_(self.dp)
            return
        if not e.gradient_average:
            return
        if not e.postscale_gradients():  # allreduce_bucket's prescale branch
            if before:
                flat.mul_(1.0 / self.dp)
            return
        f = e.gradient_predivide_factor()
        if before and f != 1.0:
            flat.mul_(1.0 / f)
        if not before and f != self.dp:
            flat.mul_(f / self.dp)

    # --- the backward -----------------------------------------------------------------------------
    def backward(self, run, chunk, kind: str = "B") -> None:
        """Run one backward pass (``run``), armed when it is ``chunk``'s last of the step; ``kind`` "W":
        a zero-bubble schedule's weight pass (``interleaved.WeightPass``), armed when it is ``chunk``'s
        last W (the linears' weight gradients finish there, the rest in the last B)."""
        seen = self._backwards.get((kind, chunk), 0) + 1
        self._backwards[(kind, chunk)] = seen
        self.armed = seen == self.engine.micro_batches
        try:
            run()
        finally:
            self.armed = False

    def _on_grad(self, p: torch.Tensor) -> None:
        if not self.armed or id(p) in self._shared or waits_for_w(p):  # waits_for_w: final in the last W
            return
        if id(p) in self._ready:
            name = next((n for n, q in self.engine.module.named_parameters() if q is p), "?")
            raise RuntimeError(
                f"the gradient of {name} was finished twice in the last micro-batch (two backward passes "
                "or chunks reach it): set mt3d.train.overlap.grad_reduce false"
            )
        self._ready.add(id(p))
        self._bucket_of[id(p)].waiting -= 1
        while self._posted < len(self.buckets) and self.buckets[self._posted].waiting == 0:
            self._post(self.buckets[self._posted])
            self.posted_in_backward += 1

    @torch.no_grad()
    def _post(self, bucket: _Bucket) -> None:
        bucket.tensors = [self._tensor(p) for p in bucket.params]
        comm = self.engine.communication_data_type
        bucket.flat = torch.cat([t.reshape(-1).to(comm) for t in bucket.tensors])
        self._scale(bucket.flat, before=True)
        if bucket.group is not None:
            bucket.work = dist.all_reduce(bucket.flat, group=bucket.group, async_op=True)
        self._posted += 1

    @torch.no_grad()
    def finish(self) -> None:
        """Post the buckets left, wait for every one, write the averages back (once per step)."""
        if self.done:
            return
        while self._posted < len(self.buckets):
            self._post(self.buckets[self._posted])
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            self._scale(b.flat, before=False)
            offset = 0
            for t in b.tensors:
                n = t.numel()
                t.copy_(b.flat[offset : offset + n].view_as(t))
                offset += n
            b.flat, b.work, b.tensors = None, None, []
        self.done = True
        if not self._logged:
            self._logged = True
            log.info("gradient reduction overlap: %d of %d buckets posted during the last backward",
                     self.posted_in_backward, len(self.buckets))  # fmt: skip

    def reset(self) -> None:
        """Start a step afresh (every ``train_batch``): what an earlier step left, one interrupted by
        an exception in a process that goes on included, is dropped, not waited for."""
        for b in self.buckets:
            b.flat, b.work, b.tensors, b.waiting = None, None, [], len(b.params)
        self._ready.clear()
        self._posted = 0
        self._backwards: dict = {}
        self.done = False
        """This step's reduction is finished."""
        self.posted_in_backward = 0
        """Buckets posted during the last backward of the latest step (what the overlap bench reads)."""


def _shared_across_chunks(module) -> set[int]:
    """ids of the parameters more than one of ``module``'s chunks run (``pipe.InterleavedPipeline``'s
    ``chunk_funcs``: modules, or DeepSpeed's tied-layer partials over one)."""
    from torch import nn

    owner: dict[int, int] = {}
    shared: set[int] = set()
    for c, funcs in enumerate(getattr(module, "chunk_funcs", None) or []):
        for f in funcs:
            m = (
                f
                if isinstance(f, nn.Module)
                else next((a for a in getattr(f, "args", ()) if isinstance(a, nn.Module)), None)
            )
            for q in m.parameters() if m is not None else ():
                if owner.setdefault(id(q), c) != c:
                    shared.add(id(q))
    return shared


def reduction_groups(engine, state=None) -> dict:
    """The process groups DeepSpeed's reduction sums gradients over, by whether they are an expert's:
    its data-parallel group; under expert parallelism with ZeRO (``mt3d.ds.experts``: ``state`` the
    rank's ParallelState) dense gradients over its ZeRO group (dp x cp) and experts' over theirs
    (dp / ep x cp), both divided by the dense group's size."""
    if state is not None and state.ep.size > 1:  # ZeRO 1 (mt3d.config.rules.overlap_conflict)
        return {False: state.dense.group, True: state.edp.group}
    group = engine.mpu.get_data_parallel_group()
    return {False: group, True: group}


def _summed_over(group):
    return group if dist.get_world_size(group) > 1 else None


def install(engine, bucket_elements: int, state=None) -> GradReduceOverlap | None:
    """Overlap ``engine``'s data-parallel gradient reduction with its backward (module docstring);
    None where there is nothing to reduce (one data-parallel rank, or DeepSpeed's reduction off).
    ``state``: the rank's ParallelState (expert parallelism: ``reduction_groups``)."""
    if all(dist.get_world_size(g) == 1 for g in reduction_groups(engine, state).values()):
        return None
    if not engine.pipeline_enable_backward_allreduce:
        return None
    ov = GradReduceOverlap(engine, bucket_elements, state)

    from .interleaved import WeightPass

    def wrap(kind, handler):
        if kind is ds_schedule.BackwardPass or kind is WeightPass:
            pass_kind = "W" if kind is WeightPass else "B"

            def backward_pass(self, buffer_id, chunk=None, **kw):
                if chunk is not None:
                    kw["chunk"] = chunk
                ov.backward(lambda: handler(self, buffer_id, **kw), chunk, pass_kind)

            return backward_pass
        if kind is ds_schedule.ReduceTiedGrads:

            def reduce_tied(self):
                ov.finish()
                return handler(self)

            return reduce_tied
        return handler

    wrap_instructions(engine, wrap)
    train_batch = engine.train_batch

    def train_batch_afresh(*args, **kwargs):
        ov.reset()
        return train_batch(*args, **kwargs)

    engine.train_batch = train_batch_afresh
    _skip_deepspeed_communication(engine, ov)
    return ov


def _skip_deepspeed_communication(engine, ov: GradReduceOverlap) -> None:
    """DeepSpeed's reduction, after ``finish``: skipped (ZeRO-0, BF16 optimizer), or with ZeRO-1's
    communication (``average_tensor``, ``buffered_reduce_fallback``) a no-op so its partition
    bookkeeping still runs."""
    for name in ("allreduce_gradients", "_bf16_reduce_grads"):
        inner = getattr(engine, name)

        def wrapped(*args, _inner=inner, **kwargs):
            if not engine.is_gradient_accumulation_boundary():
                return _inner(*args, **kwargs)
            ov.finish()
            if not ov.zero1:
                return None
            opt = engine.optimizer
            saved = opt.average_tensor, opt.buffered_reduce_fallback
            opt.average_tensor = lambda *a, **k: None
            opt.buffered_reduce_fallback = lambda *a, **k: None
            try:
                return _inner(*args, **kwargs)
            finally:
                opt.average_tensor, opt.buffered_reduce_fallback = saved

        setattr(engine, name, wrapped)
