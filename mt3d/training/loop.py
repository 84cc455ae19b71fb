"""The training loop: steps, evaluation, logging and checkpoint calls."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..config import Layout, TrainConfig
from ..config.rules import uses_pipeline_engine
from ..data.loader import DataBundle, StepBatches, step_targets
from ..model.config import ModelConfig
from ..parallel.mappings import all_reduce
from .metrics import MetricsLog, device_peak_tflops, mtp_figures, peak_memory_gb, router_figures, step_figures
from .runtime import Runtime


class Trainer:
    """Runs ``train.steps`` optimizer steps of one run on this rank."""

    def __init__(
        self,
        train: TrainConfig,
        layout: Layout,
        rt: Runtime,
        engine,
        data: DataBundle,
        model_cfg: ModelConfig,
        vocab_size: int,
        seq_len: int,
        *,
        wandb_run=None,
        start_step: int = 0,
        adapters: int | None = None,
        checkpointer=None,
        preemption=None,
        faults=None,
    ) -> None:
        self.layout, self.rt, self.engine, self.data = layout, rt, engine, data
        self.train_cfg = train
        self.pipe = uses_pipeline_engine(layout)
        self.step = start_step
        self.checkpointer = checkpointer
        self.preemption = preemption
        self.faults = faults
        self.fp16 = layout.precision == "fp16"
        self.bad_streak = 0
        self.status = "done"
        self.saved_step = start_step if start_step > 0 else None  # a resumed step is already on disk
        self.save_dir = Path(self.train_cfg.save_dir)
        self.seq_len = seq_len
        self.tokens_per_step = layout.global_batch * self.seq_len
        self.flops_per_token = model_cfg.flops_per_token(self.seq_len, vocab_size, adapters=adapters)
        self.logger = rt.rank == 0
        self.metrics = MetricsLog(self.save_dir / "metrics.jsonl", wandb_run) if self.logger else None
        self.peak, self.peak_source = (
            device_peak_tflops(self.train_cfg.peak_tflops) if self.logger else (0.0, "")
        )
        if self.train_cfg.fp8 is not None and self.logger:  # model FLOPs against bf16's peak, said so
            self.peak_source += f"; FP8 {self.train_cfg.fp8.recipe} linears counted against it"
        self.bar = None
        self.sparse = model_cfg.moe is not None
        self.mtp = model_cfg.mtp_spec.layers if model_cfg.mtp is not None else 0
        """Multi-token prediction's depths (their ids and labels go with the labels)."""
        self.depth_losses: dict = {}
        """The last step's MTP losses (``metrics.mtp_figures``)."""
        spec = model_cfg.moe_spec if self.sparse else None  # aux-loss-free balancing after each step
        self.balancing = spec is not None and spec.bias_update_rate > 0
        self.router: dict = {}
        """The last step's router figures (sparse models)."""
        self.qk_clip = getattr(engine.module, "qk_clip", None)
        self.logits: dict = {}
        """The last step's largest attention logit and clipped heads (QK-clip: ``train.muon.qk_clip``)."""
        self.packed = bool(data.info.get("packed"))
        self.targets: dict = {}
        """The last step's supervised tokens and packing efficiency (packed data)."""
        self.dpo = train.objective == "dpo"
        self.preference: dict = {}
        """The last step's DPO figures (TRL's names: rewards/..., logps/...)."""
        self.model_source = model_cfg.extra.get("hf_path") or model_cfg.name
        dpo = train.dpo
        self.reference_source = (dpo.reference_model if dpo is not None and dpo.reference_model
                                 else model_cfg.extra.get("hf_path"))  # fmt: skip
        """DPO's reference model: an HF directory (its fingerprint names the reference table), or None
        (the starting policy built from an init seed)."""

    # --- batches ---------------------------------------------------------------------------
    def batches(self, samples, step: int) -> StepBatches:
        """This rank's micro-batches of global step ``step`` (and onwards)."""
        return StepBatches(
            samples,
            global_batch=self.layout.global_batch,
            micro_batch=self.layout.micro_batch,
            grad_accum=self.layout.grad_accum,
            dp_rank=self.rt.state.dp.rank,
            start_step=step,
            device=self.rt.device,
            cp=self.rt.state.cp,
            mtp=self.mtp,
        )

    @property
    def _loss_group(self):
        """Where the pipeline engine's loss is averaged again: DeepSpeed averages it over its 'data'
        axis only, the ranks holding the same weights (dp / ep x cp before folding: the ep ranks count
        in its 'model' axis, mt3d.ds.experts), so over ep; with a folded expert layout over dp x cp,
        whose ranks DeepSpeed's 'data' groups partition evenly."""
        state = self.rt.state
        return state.dense if state.placement.expert.folded else state.ep

    def _mean_over(self, value: torch.Tensor, group) -> float:
        """``value`` averaged over ``group`` (an ``AxisGroup``)."""
        if group.size == 1:
            return float(value)
        value = value.detach().float().clone().to(self.rt.device)
        all_reduce(value, group)
        return value.item() / group.size

    def _weigh(self, samples, step: int) -> None:
        """Packed data: normalise the loss of global batch ``step`` of ``samples`` by its supervised
        targets (``LossFn.step_weight``: every rank reads the whole batch's labels, no exchange) and
        keep its figures for the log."""
        if not self.packed:
            return
        supervised, real, pairs = step_targets(samples, step, self.layout.global_batch)
        pieces = self.layout.dp * self.layout.cp * self.layout.grad_accum
        # DPO averages over the global batch's pairs, the language-model loss over its targets
        self.engine.module.loss_fn.step_weight = pieces / max(pairs if self.dpo else supervised, 1)
        positions = self.layout.global_batch * self.seq_len
        self.targets = {"supervised_tokens": supervised, "packing_efficiency": round(real / positions, 4)}
        if self.dpo:
            self.targets["pairs"] = pairs

    # --- one step ----------------------------------------------------------------------------
    def train_step(self) -> float:
        """One optimizer step on global batch ``self.step``; returns the mean loss (same on all ranks)."""
        self._weigh(self.data.train, self.step)
        it = self.batches(self.data.train, self.step)
        if self.pipe:
            return self._mean_over(self.engine.train_batch(data_iter=it), self._loss_group)
        total = torch.zeros((), device=self.rt.device)
        for _ in range(self.layout.grad_accum):
            x, y = next(it)
            loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
            total += loss.detach().float()
        return self._mean_over(total / self.layout.grad_accum, self.rt.state.dp)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over ``eval_batches`` global batches (the same ones every time)."""
        if not self.dpo:
            return self.run_eval(self.data.valid, self.train_cfg.eval_batches)
        from .dpo import evaluation_off

        with evaluation_off(self.engine.module.loss_fn):
            return self.run_eval(self.data.valid, self.train_cfg.eval_batches)

    @torch.no_grad()
    def run_eval(self, samples, batches: int) -> float:
        """Mean loss over global batches 0 .. ``batches`` - 1 of ``samples``, without training."""
        losses = []
        kept = self.targets
        for i in range(batches):
            self._weigh(samples, i)
            it = self.batches(samples, i)
            if self.pipe:
                losses.append(self._mean_over(self.engine.eval_batch(data_iter=it), self._loss_group))
                continue
            self.engine.module.eval()
            total = torch.zeros((), device=self.rt.device)
            for _ in range(self.layout.grad_accum):
                x, y = next(it)
                total += self.engine(x, y).float()
            self.engine.module.train()
            losses.append(self._mean_over(total / self.layout.grad_accum, self.rt.state.dp))
        self.targets = kept  # the figures logged are the training step's
        return sum(losses) / max(1, len(losses))

    def _track_bad(self, loss: float, skipped: bool) -> None:
        # Every rank sees the same loss (broadcast by the engine) and the same skip decision (the
        # overflow check is all-reduced), so the streak and the decision to stop agree everywhere.
        # fp16 skips steps by design while the loss scale settles; only a non-finite loss counts there.
        bad = not math.isfinite(loss) or (skipped and not self.fp16)
        self.bad_streak = self.bad_streak + 1 if bad else 0

    def save(self) -> None:
        """Checkpoint the current step (once per step)."""
        if self.checkpointer is not None and self.saved_step != self.step:
            self.checkpointer.save(self.step)
            self.saved_step = self.step

    # --- the loop --------------------------------------------------------------------------
    def _grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        if norm is None:
            return None
        return float(norm.item() if torch.is_tensor(norm) else norm)

    @property
    def _figures_holder(self) -> bool:
        """Whether this rank's loss holds its data-parallel replica's (cp-summed) figures: TP and cp
        rank 0 of the loss's stage (the last pipeline rank's, or the V's rank 0: the engine knows)."""
        return self._loss_stage and self.rt.state.tp.rank == 0 and self.rt.state.cp.rank == 0

    @property
    def _loss_stage(self) -> bool:
        """Whether this rank computes the loss: the last pipeline rank's, or the V's rank 0 (the engine
        knows)."""
        if hasattr(self.engine, "is_last_stage"):
            return self.engine.is_last_stage()
        return self.rt.state.is_last_stage

    def _router_figures(self) -> dict:
        return router_figures(self.engine.module.loss_fn, self._figures_holder, self.rt.device)

    def _log_step(self, loss: float, seconds: float) -> None:
        figs = step_figures(
            tokens=self.tokens_per_step,
            seconds=seconds,
            flops_per_token=self.flops_per_token,
            world=self.rt.world,
            peak_tflops=self.peak,
        )
        record = {
            "step": self.step,
            "loss": loss,
            "lr": float(self.engine.get_lr()[0]),
            "grad_norm": self._grad_norm(),
            **figs,
            "skipped": int(self.engine.skipped_steps),
            "bad_streak": self.bad_streak,
            "samples": self.step * self.layout.global_batch,
            "step_time_s": seconds,
            "peak_mem_gb": peak_memory_gb(),
            **self.targets,
            **self.router,
            **self.preference,
            **self.logits,
            **self.depth_losses,
        }
        self.metrics.write(record, wandb_step=self.engine.global_samples)
        gn = record["grad_norm"]
        line = (
            f"step {self.step:>6}/{self.train_cfg.steps} | loss {loss:.4f} | lr {record['lr']:.3e} | "
            f"grad norm {gn if gn is None else f'{gn:.3f}'} | {figs['tokens_per_s']:.0f} tok/s | "
            f"{figs['tflops_per_gpu']:.3g} TFLOP/s/dev | MFU {figs['mfu']:.1%} | "
            f"skipped {record['skipped']} | peak mem {record['peak_mem_gb']:.2f} GB"
        )
        if self.targets:
            line += (
                f" | supervised {self.targets['supervised_tokens']}"
                f" | packed {self.targets['packing_efficiency']:.1%}"
            )
        if self.preference:
            p = self.preference
            line += (f" | reward acc {p['rewards/accuracies']:.3f} | margin {p['rewards/margins']:.4f}"
                     f" | pairs {self.targets['pairs']}")  # fmt: skip
        if self.router:
            r = self.router
            line += (
                f" | aux {r['moe_aux_loss']:.3f} | expert load max/mean {r['expert_load_max_over_mean']:.2f}"
                f" | dropped {r['dropped_tokens']}"
            )
        if self.logits:
            top, clipped = self.logits["attn_logit_max"], self.logits["qk_clipped_heads"]
            line += f" | max logit {top:.2f} (clipped {clipped})"
        self._print(line)

    def _print(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def _eval_and_log(self) -> float:
        loss = self.evaluate()
        if self.logger and self.dpo:  # a preference loss has no perplexity
            self.metrics.write({"step": self.step, "eval_loss": loss}, self.engine.global_samples)
            self._print(f"step {self.step:>6} | eval DPO loss {loss:.4f}")
        elif self.logger:
            ppl = math.exp(min(loss, 50.0))
            self.metrics.write(
                {"step": self.step, "eval_loss": loss, "eval_ppl": ppl}, self.engine.global_samples
            )
            self._print(f"step {self.step:>6} | eval loss {loss:.4f} | eval perplexity {ppl:.2f}")
        return loss

    def _after_step(self, skipped: bool) -> None:
        """What follows an optimizer step: aux-loss-free balancing, the router's and DPO's figures."""
        if self.balancing:
            from ..model.moe import balance_experts

            balance_experts(self.engine.module, self.rt.state.dense, self.rt.state.tp, not skipped)
        if self.sparse:
            self.router = self._router_figures()
        if self.qk_clip is not None:
            self.logits = self.qk_clip.figures(self.rt.device)
        if self.mtp:  # every cp rank's loss holds a share of the depths'
            holder = self._loss_stage and self.rt.state.tp.rank == 0
            self.depth_losses = mtp_figures(self.engine.module.loss_fn, holder, self.rt.device, self.mtp)
        if self.dpo:
            from .dpo import dpo_figures

            self.preference = dpo_figures(self.engine.module.loss_fn, self._figures_holder, self.rt.device)

    def train(self) -> dict:
        """Run to ``train.steps``; returns a summary (last loss, last eval loss)."""
        cfg = self.train_cfg
        if self.logger:
            self._print(
                f"training {cfg.steps - self.step} steps from step {self.step}: "
                f"{self.tokens_per_step} tokens/step, peak {self.peak:.3g} TFLOP/s/dev ({self.peak_source})"
            )
            if cfg.progress and sys.stderr.isatty():  # a bar in a log file is just noise
                from tqdm import tqdm

                self.bar = tqdm(total=cfg.steps, initial=self.step, unit="step", dynamic_ncols=True)
        last_loss = float("nan")
        eval_loss = None
        if self.dpo:
            from .dpo import prepare_reference

            prepare_reference(self, self.step)
        try:
            while self.step < cfg.steps:
                if self.faults:
                    self.faults.before_step(self.step + 1, self.engine.module)
                skipped_before = self.engine.skipped_steps
                t0 = time.perf_counter()
                last_loss = self.train_step()
                seconds = time.perf_counter() - t0
                self._after_step(self.engine.skipped_steps > skipped_before)
                self.step += 1
                self._track_bad(last_loss, self.engine.skipped_steps > skipped_before)
                if self.logger:
                    if self.bar is not None:
                        self.bar.update(1)
                        self.bar.set_postfix(
                            loss=f"{last_loss:.3f}", tok_s=f"{self.tokens_per_step / seconds:.0f}"
                        )
                    if self.step % cfg.log_interval == 0 or self.step == cfg.steps:
                        self._log_step(last_loss, seconds)
                if self.faults:
                    self.faults.after_step(self.step)
                if self.bad_streak >= cfg.max_bad_steps:
                    self._print(
                        f"stopping: {self.bad_streak} consecutive steps with non-finite loss or gradients "
                        f"(train.max_bad_steps = {cfg.max_bad_steps}); saving the last good state"
                    )
                    self.status = "diverged"
                    self.save()
                    break
                if self.preemption is not None and self.preemption.agreed(self.rt.device):
                    self._print(
                        f"stop requested (signal) at step {self.step}: saving a checkpoint and exiting"
                    )
                    self.status = "preempted"
                    self.save()
                    break
                if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.steps:
                    eval_loss = self._eval_and_log()
                if cfg.save_interval and self.step % cfg.save_interval == 0:
                    self.save()
            if self.status == "done":
                if cfg.eval_batches > 0:
                    eval_loss = self._eval_and_log()
                if cfg.save_at_end:
                    self.save()
        finally:
            if self.bar is not None:
                self.bar.close()
            if self.metrics is not None:
                self.metrics.close()
        if dist.is_initialized():
            dist.barrier()
        return {"step": self.step, "loss": last_loss, "eval_loss": eval_loss, "status": self.status}
