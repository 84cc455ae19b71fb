"""Layout rules: what combinations of degrees, ZeRO stage, schedule, offload and batch sizes can run.

The one home of each rule: ``mt3d.config`` applies them to a run before any process group exists,
``mt3d.planner`` to every candidate it enumerates (short reasons), checkpoints to a resume.
"""

from __future__ import annotations

from .deepspeed import Offload
from .errors import ConfigError
from .moe_rules import (  # noqa: F401 - the MoE rules, read from here too
    DISPATCHES,
    chunks_conflict,
    dispatch_conflict,
    dispatch_hosts_conflict,
    expert_conflict,
    folding_conflict,
    moe_conflict,
    overlap_moe_conflict,
)
from .optimizer_rules import muon_conflict, qk_clip_conflict  # noqa: F401 - read from here too
from .pipeline_rules import (  # noqa: F401 - the pipeline's rules, read from here too
    p2p_conflict,
    schedule_conflict,
    virtual_stage_conflict,
    zero_pipeline_conflict,
)
from .placement_rules import order_conflict  # noqa: F401 - read from here too
from .schema import DataConfig, ParallelConfig, TrainConfig


def degrees_for(par: ParallelConfig, world: int) -> dict[str, int]:
    """Every axis's degree for ``world`` ranks (dp derived), or the one-line reason it cannot be."""
    from ..parallel.axes import AxisError, derive_degrees

    for key, value in ((k, getattr(par, k)) for k in ("tensor", "context", "expert", "pipeline")):
        if value <= 0:
            raise ConfigError(f"mt3d.parallel.{key} must be positive, got {value}")
    try:
        return derive_degrees(world, par.degrees(), by_key=True, fix="change mt3d.parallel",
                              expert_tensor=par.expert_tensor)  # fmt: skip
    except AxisError as e:
        raise ConfigError(str(e)) from None


def uses_pipeline_engine(layout) -> bool:
    """Whether a layout trains on DeepSpeed's pipeline engine (ZeRO 0/1, any pp, 1 included) rather
    than its regular engine (ZeRO-2/3, pp 1). ``layout``: anything with a ``zero_stage``."""
    return layout.zero_stage < 2


def offload_conflict(zero_stage: int, off: Offload, short: bool = False) -> str | None:
    """Why this offload cannot run at ZeRO ``zero_stage`` (None: it can); ``short``: the planner's
    phrasing of the same rule.

    The running DeepSpeed accepts some of these and then ignores them: parameter offload below
    ZeRO-3, and NVMe optimizer offload below ZeRO-3 (which it runs as CPU offload)."""
    from ..versions import running_version

    if not off.any:
        return None
    version = running_version()
    missing = [
        k for k in ("param", "optimizer") if getattr(off, k) == "nvme" and not getattr(off, f"{k}_path")
    ]
    if zero_stage == 0:
        brief = "offload needs ZeRO 1-3"
        full = (
            "offloading needs ZeRO (zero_optimization.stage 1-3); stage 0 has nothing partitioned to offload"
        )
    elif off.param != "none" and zero_stage != 3:
        brief = f"offload {off.label} needs ZeRO-3"
        full = (
            "zero_optimization.offload_param needs ZeRO stage 3 (DeepSpeed ignores it at stage "
            f"{zero_stage}); "
            "ZeRO-3 needs pipeline 1. Offload the optimizer only (offload_optimizer) at 1/2"
        )
    elif off.optimizer == "nvme" and zero_stage != 3:
        brief = f"offload {off.label} needs ZeRO-3"
        full = (
            f"offload_optimizer.device nvme needs ZeRO stage 3 (DeepSpeed {version} runs it as cpu at "
            f"stage {zero_stage}); use device cpu, or stage 3 with pipeline 1"
        )
    elif missing:
        brief = f"offload {off.label} needs an nvme_path"
        full = (
            f"zero_optimization.offload_{missing[0]}.device nvme needs nvme_path (a directory on a local "
            "NVMe disk)"
        )
    else:
        return None
    return brief if short else full


def optimizer_device(label: str) -> str:
    """The optimizer's device in an ``Offload.label`` (none, cpu, nvme)."""
    return label.rsplit("opt-", 1)[1] if "opt-" in label else label


def offload_resume_conflict(saved: str, now: str, layout_changed: bool) -> str | None:
    """Why a checkpoint saved with offload ``saved`` cannot resume with offload ``now`` (labels).

    Parameters and optimizer states on the CPU are saved in the same files as without offload, so
    those resume either way. DeepSpeed saves NVMe-offloaded optimizer states as a copy of the swap
    files (``offloaded_tensors/rank*``) and leaves empty tensors in ``*_optim_states.pt``; it restores
    them only into the same NVMe layout, and reads nothing else then. mt3d converts such a checkpoint
    for a run without NVMe optimizer offload at the same layout
    (``mt3d.checkpoint.reshard.convert_for_resume``); the other direction is refused."""
    was, will = optimizer_device(saved), optimizer_device(now)
    if "nvme" not in (was, will) or (was == will and not layout_changed):
        return None
    if was == "nvme" and not layout_changed:
        return None  # converted on resume
    if was == "nvme":
        return (
            "a checkpoint with NVMe-offloaded optimizer states resumes only at the layout it was saved "
            + ("with (DeepSpeed keeps them as per-rank swap files); " if was == will else "with; ")
            + "for another layout, export-hf and start from those weights (model.from_hf)"
        )
    return (
        f"the checkpoint's optimizer states were saved with offload {saved!r} and this run uses {now!r}: "
        "an NVMe run of DeepSpeed reads optimizer states only from swap files an NVMe run saved; "
        "keep the checkpoint's offload_optimizer device, or export-hf and start the NVMe run from those "
        "weights (model.from_hf: fresh optimizer states)"
    )


def batch_split(keys: dict, dp: int) -> tuple[int, int, int]:
    """(micro-batch, accumulation steps, global batch) from DeepSpeed's batch keys for ``dp`` ranks."""
    gb, mb, ga = (
        keys["train_batch_size"],
        keys["train_micro_batch_size_per_gpu"],
        keys["gradient_accumulation_steps"],
    )
    for name, v in keys.items():
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"{name} must be a positive integer, got {v!r}")
    if mb is None and gb is not None and ga is not None:
        if gb % (ga * dp):
            raise ConfigError(
                f"train_batch_size {gb} is not divisible by gradient_accumulation_steps*dp = {ga}*{dp}"
            )
        mb = gb // (ga * dp)
    mb = mb or 1
    if ga is None:
        if gb is None:
            ga = 1
        elif gb % (mb * dp):
            raise ConfigError(
                f"train_batch_size {gb} is not divisible by micro-batch*dp = {mb}*{dp}; "
                f"use a multiple of {mb * dp}"
            )
        else:
            ga = gb // (mb * dp)
    if gb is None:
        gb = mb * ga * dp
    if mb * ga * dp != gb:
        raise ConfigError(
            f"train_batch_size {gb} != micro-batch {mb} x gradient_accumulation_steps {ga} x dp {dp}; "
            "fix one of them (or drop gradient_accumulation_steps to derive it)"
        )
    return mb, ga, gb


def check_train(train: TrainConfig) -> None:
    """Bounds of the training loop's keys."""
    bounds = {
        "steps": 0,
        "log_interval": 1,
        "eval_interval": 0,
        "eval_batches": 0,
        "save_interval": 0,
        "keep_last": 0,
        "max_bad_steps": 1,
    }
    for key, low in bounds.items():
        if getattr(train, key) < low:
            raise ConfigError(f"mt3d.train.{key} must be >= {low}, got {getattr(train, key)}")
    for key in ("interval", "tile_len"):
        if getattr(train.recompute, key) < 0:
            raise ConfigError(f"mt3d.train.recompute.{key} must be >= 0, got {getattr(train.recompute, key)}")
    rec = train.recompute
    if rec.granularity not in ("full", "selective"):
        got = rec.granularity
        raise ConfigError(f"mt3d.train.recompute.granularity must be full or selective, got {got!r}")
    if rec.granularity == "selective" and rec.interval > 0:
        raise ConfigError(
            "mt3d.train.recompute.granularity selective recomputes parts of every block; interval "
            f"{rec.interval} asks for whole blocks (granularity full): use one of them"
        )
    if train.overlap.bucket_elements < 1:
        raise ConfigError(
            f"mt3d.train.overlap.bucket_elements must be >= 1, got {train.overlap.bucket_elements}"
        )
    if train.eval_interval > 0 and train.eval_batches == 0:
        raise ConfigError("mt3d.train.eval_interval > 0 needs eval_batches >= 1 (or set eval_interval 0)")
    if train.peak_tflops is not None and train.peak_tflops <= 0:
        raise ConfigError(f"mt3d.train.peak_tflops must be positive, got {train.peak_tflops}")
    if train.wandb_mode not in ("offline", "online", "disabled"):
        raise ConfigError(
            f"mt3d.train.wandb_mode must be offline, online or disabled, got {train.wandb_mode!r}"
        )


def fp8_conflict(fp8, precision: str) -> str | None:
    """Why ``mt3d.train.fp8`` cannot run with this precision (None: it can, or fp8 is off)."""
    from ..parallel.fp8 import RECIPES

    if fp8 is None:
        return None
    if fp8.recipe not in RECIPES:
        return f"mt3d.train.fp8.recipe must be one of {', '.join(RECIPES)}, got {fp8.recipe!r}"
    if fp8.experts and not RECIPES[fp8.recipe].block:
        return (
            f"mt3d.train.fp8.experts needs a tiled recipe (blockwise or mxfp8): the experts' token counts "
            f"vary, which {fp8.recipe} GEMMs (every dimension a multiple of 16) cannot take"
        )
    if fp8.dispatch and not RECIPES[fp8.recipe].block:
        return (
            f"mt3d.train.fp8.dispatch needs a tiled recipe (blockwise or mxfp8): the dispatched rows carry "
            f"their tiles' scales, and {fp8.recipe} has none per row"
        )
    if precision != "bf16":
        return (
            f"mt3d.train.fp8 runs the linears' GEMMs in FP8 beside bf16 weights and activations: set "
            f'"bf16": {{"enabled": true}} (this config trains in {precision})'
        )
    return None


def fp8_cover_conflict(fp8, layers: int) -> str | None:
    """Why ``mt3d.train.fp8`` would run no GEMM in FP8 (None: some block's linears take it)."""
    if fp8 is not None and fp8.exclude_first_last and layers <= 2:
        return (f"mt3d.train.fp8 covers no linear: exclude_first_last keeps the first and last block in bf16 "
                f"and the model has {layers}; drop exclude_first_last or mt3d.train.fp8")  # fmt: skip
    return None


def fp8_notes(fp8, sequence_parallel: bool, tp: int, ep: int = 1) -> list[str]:
    """What an FP8 setting does not do in this layout (warnings, not errors)."""
    notes = []
    if fp8 is not None and fp8.all_gather and not (sequence_parallel and tp > 1):
        notes.append(
            "mt3d.train.fp8.all_gather does nothing here: it casts the sequence-parallel all-gather's "
            "inputs, and this run has no sequence parallelism (parallel.sequence_parallel with tensor > 1)"
        )
    if fp8 is not None and fp8.dispatch and ep <= 1:
        notes.append(
            "mt3d.train.fp8.dispatch does nothing here: it casts the expert-parallel dispatch, and this "
            "run has no expert parallelism (parallel.expert > 1)"
        )
    return notes


def fp8_shape_conflict(model, tp: int, tokens: int, recipe: str = "tensorwise", experts: bool = False,
                       etp: int = 1, dispatch: bool = False) -> str | None:  # fmt: skip
    """Why the blocks' FP8 GEMMs cannot run at tensor parallelism ``tp`` with ``tokens`` rows per
    micro-batch and rank (micro-batch x seq_len / cp): every GEMM dimension must be a multiple of 16,
    and a tiled recipe's weight dimensions of its tile (blockwise 128, mxfp8 32; the tokens' last tile
    may be partial, scaled by its own amax); with ``experts`` the routed experts' (split over ``etp``)."""
    from ..parallel.fp8 import MULTIPLE, RECIPES

    need = RECIPES[recipe].multiple
    dims = {"hidden": model.hidden, "q heads x head_dim / tp": model.q_size // tp,
            "kv heads x head_dim / tp": model.kv_size // tp, "ffn / tp": model.ffn // tp}  # fmt: skip
    spec, gdn = model.moe_spec, model.gdn_spec
    if gdn is not None:  # the DeltaNet's q/k/v/z projections and its output
        dims.update({"linear key_dim / tp": gdn.key_dim // tp, "linear value_dim / tp": gdn.value_dim // tp})
    if spec is not None and spec.shared_ffn:
        dims["shared_ffn / tp"] = spec.shared_ffn // tp
    for key, on in (("dispatch", dispatch), ("experts", experts)):
        if on and spec is None:
            return f"mt3d.train.fp8.{key}: the model has no routed experts (model.moe); drop {key}"
    if experts:
        dims["expert_ffn / expert_tensor"] = spec.expert_ffn // etp
    bad = {k: v for k, v in dims.items() if v % need}
    if tokens % MULTIPLE:
        bad["tokens per micro-batch (micro x seq_len / cp)"] = tokens
    if bad:
        what = ", ".join(f"{k} = {v}" for k, v in bad.items())
        return (
            f"mt3d.train.fp8: {recipe} FP8 GEMMs need every weight dimension a multiple of {need} and the "
            f"tokens of {MULTIPLE}; {what} is not"
        )
    return None


def overlap_conflict(grad_reduce: bool, zero_stage: int, ep: int, off: Offload, precision: str) -> str | None:
    """Why ``mt3d.train.overlap.grad_reduce`` cannot run with this layout (None: it can)."""
    if not grad_reduce:
        return None
    key = "mt3d.train.overlap.grad_reduce"
    if zero_stage >= 2:
        return (f"{key} is for the pipeline engine (ZeRO 0/1); ZeRO-{zero_stage}'s reduction overlaps the "
                "backward already when zero_optimization.overlap_comm is true: set that instead")  # fmt: skip
    why = None
    if ep > 1 and zero_stage == 0:
        why = (
            "expert parallelism without ZeRO (dense gradients take two hops there, over ep and then "
            "DeepSpeed's dp / ep x cp: mt3d.ds.experts); use zero_optimization.stage 1"
        )
    elif off.any:
        why = "optimizer offload (DeepSpeed copies gradients to the CPU inside its own reduction)"
    elif precision == "fp16":
        why = "fp16 (DeepSpeed's loss-scaled fp16 optimizer is not covered: use bf16)"
    return f"{key} is not supported with {why}; set it false" if why else None


def optimizer_states_conflict(
    states: str, precision: str, zero_stage: int, off: Offload, ds: dict
) -> str | None:
    """Why ``mt3d.train.optimizer_states`` cannot be ``states`` here (None: it can). DeepSpeed's own keys
    for it are set by mt3d (``ds.engine.deepspeed_config``), never by hand: given alone they are
    silently ignored where DeepSpeed picks its BF16 optimizer (fp32 gradient accumulation)."""
    key = "mt3d.train.optimizer_states"
    bf16 = ds.get("bf16") or {}
    if states == "fp32" and (bf16.get("bf16_master_weights_and_grads") or bf16.get("bf16_optimizer_states")):
        return (f"bf16.bf16_master_weights_and_grads / bf16_optimizer_states are set by {key} 'bf16' "
                "(which also accumulates gradients in bf16, without which DeepSpeed ignores them): "
                "set that")  # fmt: skip
    if states == "fp32":
        return None
    if states == "bf16-moments":
        return (f"{key} 'bf16-moments' (fp32 master weights, bf16 moments) is not something "
                "DeepSpeed runs (its bf16_optimizer_states needs bf16 master weights): use 'bf16' or "
                "'fp32'")  # fmt: skip
    if states != "bf16":
        return f"{key} must be fp32 or bf16, got {states!r}"
    why = None
    if precision != "bf16":
        why = f"bf16 training (this run is {precision}: set bf16.enabled true)"
    elif zero_stage == 0:
        why = "ZeRO 1-3 (DeepSpeed keeps bf16 master weights only in its ZeRO optimizers)"
    elif off.optimizer != "none":
        why = (
            "the optimizer on the accelerator (with offload DeepSpeed's CPU Adam would need its own setting)"
        )
    elif ((ds.get("data_types") or {}).get("grad_accum_dtype") or "bf16") not in ("bf16", "bfloat16"):
        why = "gradients accumulated in bf16 (data_types.grad_accum_dtype: remove it or set bf16)"
    return f"{key} 'bf16' needs {why}" if why else None


DTYPE_NAMES = {
    "fp32": ("fp32", "float32", "float", "torch.float32"),
    "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"),
}
"""How DeepSpeed's ``data_types.grad_accum_dtype`` may name each dtype (its ``DtypeEnum``)."""


def grad_accum_conflict(grad_dtype: str, precision: str, zero_stage: int, off: Offload, states: str = "fp32",
                        planned: bool = False) -> str | None:  # fmt: skip
    """Why gradients cannot accumulate in ``grad_dtype`` (a ``DTYPE_NAMES`` spelling; empty: the weights'
    dtype) beside ``precision`` weights (None: they can). DeepSpeed mixes the two dtypes only in its ZeRO
    optimizers (at ZeRO 0 it raises NotImplementedError once the model is built). ``planned``: what
    ``mt3d plan`` sizes, the path mt3d's tests cover: fp32 gradients as DeepSpeed's BF16 optimizer
    (bf16, ZeRO-1, the optimizer on the accelerator, fp32 optimizer states: a full fp32 gradient buffer,
    the master weights and moments partitioned)."""
    if not grad_dtype:
        return None
    accum = next((name for name, spellings in DTYPE_NAMES.items() if grad_dtype in spellings), None)
    if accum is None:
        return (f"data_types.grad_accum_dtype {grad_dtype!r} is not a dtype DeepSpeed knows (its names are "
                "case-sensitive): use fp32, fp16 or bf16")  # fmt: skip
    if accum == precision:
        return None
    if zero_stage == 0:
        return (f"data_types.grad_accum_dtype {grad_dtype} beside {precision} weights needs ZeRO (DeepSpeed "
                "mixes the two only in its ZeRO optimizers): set zero_optimization.stage 1 or remove "
                "data_types.grad_accum_dtype")  # fmt: skip
    if planned and (precision != "bf16" or zero_stage != 1 or off.optimizer != "none" or states != "fp32"):
        return ("fp32 gradients are planned as DeepSpeed's BF16 optimizer: bf16, ZeRO-1, no optimizer "
                "offload, fp32 optimizer states")  # fmt: skip
    return None


def tiles_conflict(tile_len: int, zero_stage: int) -> str | None:
    """Why sequence tiles cannot run with this ZeRO stage (None: they can)."""
    if tile_len > 0 and zero_stage == 3:
        return (
            "mt3d.train.recompute.tile_len is not supported with ZeRO-3 yet (its weight gathering is not "
            "wired into the tiles' recompute): use ZeRO stage 0-2, or tile_len 0"
        )
    return None


def check_data(data: DataConfig, evaluates: bool = True) -> None:
    """Values of the data keys (files are ``preflight``'s); ``evaluates``: the run reads the
    validation split (``train.eval_batches`` > 0), which then needs a weight."""
    if data.seq_len <= 0:
        raise ConfigError(f"mt3d.data.seq_len must be positive, got {data.seq_len}")
    if data.corpus not in ("builtin", "synthetic", "indexed"):
        raise ConfigError(f"mt3d.data.corpus must be builtin, synthetic or indexed, got {data.corpus!r}")
    if len(data.split) != 3 or min(data.split) < 0 or data.split[0] <= 0:
        raise ConfigError(
            f"mt3d.data.split must be 3 non-negative weights (train, valid, test) with train > 0, got "
            f"{data.split}"
        )
    if evaluates and data.split[1] <= 0:
        raise ConfigError(
            f"mt3d.data.split {data.split} gives the validation split no documents but the run evaluates "
            "(mt3d.train.eval_batches > 0): give split[1] a weight, or set mt3d.train.eval_batches=0"
        )
    if data.weights is not None and (min(data.weights, default=0) < 0 or sum(data.weights) <= 0):
        raise ConfigError(f"mt3d.data.weights must be non-negative and not all zero, got {data.weights}")
    if data.corpus == "indexed" and data.weights is not None and len(data.weights) != len(data.prefixes):
        raise ConfigError("mt3d.data.weights must have one weight per prefix")
    if data.corpus == "builtin" and data.tokenizer is None and data.vocab_size < 257:
        raise ConfigError(
            f"mt3d.data.vocab_size must be > 256 for the builtin corpus's BPE, got {data.vocab_size}"
        )
    if data.corpus == "synthetic" and data.vocab_size < 8:
        raise ConfigError(
            f"mt3d.data.vocab_size must be >= 8 for the synthetic corpus, got {data.vocab_size}"
        )


def context_zero_conflict(cp: int, zero_stage: int) -> str | None:
    """Why this ZeRO stage cannot run with context parallelism (None: it can)."""
    if cp > 1 and zero_stage >= 2:
        return (
            "context parallelism runs inside DeepSpeed's pipeline engine, which averages gradients over "
            "dp x cp: use zero_optimization.stage 0 or 1 (ZeRO-2/3 are not supported with it yet)"
        )
    return None


def context_sequence_conflict(cp: int, tp: int, seq_len: int, sequence_parallel: bool) -> str | None:
    """Why a sequence cannot be cut into this rank's chunks (and SP shards) (None: it can)."""
    if cp > 1 and seq_len % (2 * cp):
        return (
            f"context parallelism needs seq_len {seq_len} divisible by 2 x cp = {2 * cp} (rank i holds "
            f"chunks i and {2 * cp - 1}-i of every sample)"
        )
    if cp > 1 and sequence_parallel and tp > 1 and (seq_len // cp) % tp:
        return f"sequence parallelism needs seq_len / cp ({seq_len // cp}) divisible by tp ({tp})"
    return None


def context_conflict(par: ParallelConfig, degrees: dict[str, int], seq_len: int, zero_stage: int,
                     model=None) -> str | None:  # fmt: skip
    """Why context parallelism cannot run as configured (None: it can, as far as the inputs tell)."""
    from ..parallel.context import EXCHANGES, ulysses_heads_ok

    if par.context_exchange not in EXCHANGES:
        got = par.context_exchange
        return f"mt3d.parallel.context_exchange must be one of {', '.join(EXCHANGES)}, got {got!r}"
    cp, tp = degrees["cp"], degrees["tp"]
    if cp == 1:
        return None
    why = context_zero_conflict(cp, zero_stage) or context_sequence_conflict(
        cp, tp, seq_len, par.sequence_parallel
    )
    if why:
        return why
    why = model.gdn_spec.parallel_conflict(1, cp, seq_len) if model is not None and model.gdn_spec else None
    if why:
        return why
    if model is not None and par.context_exchange == "alltoall":
        heads, kv = model.heads // tp, model.kv_heads // tp
        if not ulysses_heads_ok(heads, kv, cp):
            return (
                f"context_exchange alltoall needs heads / tp ({heads}) divisible by cp ({cp}) and kv_heads / "
                f"tp ({kv}) dividing or divisible by cp; use context_exchange allgather (or auto)"
            )
    return None


def objective_conflict(train, model: dict | None = None) -> str | None:
    """Why ``mt3d.train.objective`` and ``mt3d.train.dpo`` cannot run (None: they can); ``model``: the
    run's ``mt3d.model`` (a reference 'model' defaults to its ``from_hf``)."""
    if train.objective not in ("lm", "dpo"):
        return f"mt3d.train.objective must be 'lm' or 'dpo', got {train.objective!r}"
    if train.objective == "dpo" and (model or {}).get("mtp") is not None:
        return "mt3d.model.mtp trains next-token objectives, not DPO: drop model.mtp for this run"
    dpo = train.dpo
    if dpo is None:
        return None
    if train.objective != "dpo":
        return "mt3d.train.dpo is set but mt3d.train.objective is 'lm': set objective 'dpo' (or drop dpo)"
    if not dpo.beta > 0:
        return f"mt3d.train.dpo.beta must be positive, got {dpo.beta}"
    if dpo.loss_type not in ("sigmoid", "ipo"):
        return f"mt3d.train.dpo.loss_type must be 'sigmoid' or 'ipo', got {dpo.loss_type!r}"
    if not 0 <= dpo.label_smoothing < 0.5 or (dpo.label_smoothing and dpo.loss_type != "sigmoid"):
        return (f"mt3d.train.dpo.label_smoothing must be in [0, 0.5) and goes with loss_type 'sigmoid', got "
                f"{dpo.label_smoothing} with {dpo.loss_type!r}")  # fmt: skip
    if dpo.reference not in ("precompute", "model"):
        return (
            f"mt3d.train.dpo.reference must be 'precompute' (the starting policy; with LoRA the frozen "
            f"base) or 'model' (reference_model), got {dpo.reference!r}"
        )
    if dpo.reference_model is not None and dpo.reference != "model":
        return "mt3d.train.dpo.reference_model goes with reference 'model': set it (or drop reference_model)"
    if dpo.reference == "model" and not (dpo.reference_model or (model or {}).get("from_hf")):
        return ("mt3d.train.dpo.reference 'model' needs reference_model (an HF directory or mt3d "
                "checkpoint) when the policy is not model.from_hf")  # fmt: skip
    return None
