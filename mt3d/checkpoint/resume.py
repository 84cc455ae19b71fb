"""Choosing, verifying and restoring the checkpoint a run resumes from.

``plan_resume`` (before ``deepspeed.initialize``) picks the checkpoint (``resume: auto`` = the
newest complete one in save_dir, never one without a valid manifest) and decides whether the
layout changed. ``verify_everywhere`` checks every file's sha256 against the manifest, each rank
hashing a share, before any tensor is used. ``restore`` loads the engine state (model, optimizer,
scheduler, loss scaler, counters) and this rank's random state.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from ..config import Layout, offload_resume_conflict, optimizer_device
from ..config.layout import PARAM_GROUPS
from ..config.rules import uses_pipeline_engine
from ..ds.optim_states import accept_adam_states_across_implementations, steps_as_their_optimizer_keeps_them
from ..errors import UserError
from ..model.config import BLOCK_OPTIONS, ModelConfig
from ..model.peft import FULL, same_base
from ..parallel.axes import NAMES, deepspeed_sizes
from .manager import SUPERSEDED, checkpoints_dir, complete_checkpoints, has_frozen
from .manifest import CheckpointError, check_sizes, read_manifest, verify_everywhere
from .rng import load_rng, rng_key

log = logging.getLogger("mt3d")


# changed on resume: a warning (the weights still fit); anything else that differs is refused
SOFT_KEYS = (
    "rope_theta",
    "rope_scaling",
    "rope_local",
    "norm_eps",
    "hidden_dropout",
    "attention_dropout",
    "attention",
    "attn_softcap",
    "logit_softcap",
    "query_pre_attn_scalar",
    "family",
)
ARCH_KEYS = ("hidden", "layers", "heads", "kv_heads", "ffn", "head_dim") + tuple(
    k for k in BLOCK_OPTIONS if k not in SOFT_KEYS
)


@dataclass
class ResumePlan:
    """The checkpoint to resume from and how."""

    path: Path
    meta: dict
    manifest: dict

    @property
    def step(self) -> int:
        """The step the checkpoint was written after."""
        return int(self.meta["step"])

    def layout_changed(self, layout: Layout) -> bool:
        """Whether the saved (tp, pp, dp, zero stage, virtual stages, blocks per stage) differ from
        ``layout``: any difference moves parameters between ranks or reorders a rank's optimizer
        partition, so the checkpoint is loaded through the universal (resharding) path."""
        saved = dict(self.meta["layout"])
        saved.setdefault("virtual_stages", 1)  # checkpoints from before virtual stages
        if saved.get("stage_blocks") is None:  # ... and before the blocks were recorded
            from ..model.pipeline import default_stage_blocks

            model = self.meta.get("model") or {}
            chunks = saved["pp"] * saved["virtual_stages"]
            saved["stage_blocks"] = self.meta.get("stage_layers") or (
                default_stage_blocks(model["layers"], chunks) if "layers" in model else None
            )
        now = layout.saved()
        if now["stage_blocks"] is None:
            now.pop("stage_blocks")
        now.pop("offload")  # where states live is not how they are partitioned (check_offload)
        from ..parallel.axes import NAMES

        for axis in NAMES:  # an optional axis of size 1 is left out of either record
            saved.setdefault(axis, 1)
            now.setdefault(axis, 1)
        for record in (saved, now):  # ... and the expert-tensor degree when it is tp's
            record.setdefault("etp", record["tp"])
        if saved["ep"] > 1 and saved["zero_stage"] > 0:  # from before these were recorded
            saved.setdefault("dense_partition", "dp / ep x cp")
            saved.setdefault("param_groups", PARAM_GROUPS[False])
        return any(saved.get(k) != v for k, v in now.items())

    def check_offload(self, layout: Layout) -> bool:
        """Refuse a resume across offload devices that DeepSpeed cannot load (NVMe optimizer states);
        True when the checkpoint's NVMe optimizer states must be converted for this run."""
        saved = self.meta["layout"].get("offload", "none")  # checkpoints from before offload: none
        why = offload_resume_conflict(saved, layout.offload, self.layout_changed(layout))
        if why:
            raise CheckpointError(f"{self.path}: {why}")
        return optimizer_device(saved) == "nvme" and optimizer_device(layout.offload) != "nvme"


def candidates(resume: str, save_dir: str | Path) -> list[Path]:
    """Checkpoints a ``train.resume`` value allows, best first ([] : start from scratch).

    ``auto``: every complete checkpoint of save_dir, newest first. A path: that checkpoint, or the
    newest complete one of that run directory.
    """
    if resume == "none":
        return []
    if resume == "auto":
        found = complete_checkpoints(checkpoints_dir(save_dir))[::-1]
        if not found:
            root = checkpoints_dir(save_dir)
            bad = sorted(p.name for p in root.glob("step_*")) if root.is_dir() else []
            old = sorted(p.name for p in (root / SUPERSEDED).glob("step_*")) if root.is_dir() else []
            if bad:
                log.warning(
                    "resume auto: no complete checkpoint in %s (incomplete: %s); starting fresh", root, bad
                )
            if old:
                log.warning(
                    "resume auto: %s holds only superseded checkpoints of an abandoned history (%s); "
                    "starting fresh (resume one of them by its path to continue it)", root, ", ".join(old),
                )  # fmt: skip
        return found
    p = Path(resume)
    if (p / "manifest.json").is_file() or p.name.startswith("step_"):
        check_sizes(p, read_manifest(p))
        return [p]
    found = complete_checkpoints(checkpoints_dir(p))
    if not found:
        raise CheckpointError(f"resume: no complete checkpoint in {p}")
    return [found[-1]]


def _check_model(path: Path, meta: dict, model: ModelConfig, run_facts: dict | None = None) -> None:
    """Refuse a checkpoint of another architecture (shapes); warn about changed hyper-parameters."""
    try:  # through ModelConfig: checkpoints from before a field existed get its default
        saved = ModelConfig.from_dict(meta["model"]).to_dict()
    except (UserError, TypeError) as e:
        raise CheckpointError(f"{path}/manifest.json: unreadable model config ({e})") from None
    now = model.to_dict()
    keys = list(ARCH_KEYS) + (["max_seq_len"] if now.get("position") == "learned" else [])
    diff = [k for k in keys if saved.get(k) != now.get(k)]
    if model.vocab_size is not None and meta.get("vocab_size") not in (None, model.vocab_size):
        diff.append("vocab_size")
        saved, now = {**saved, "vocab_size": meta["vocab_size"]}, {**now, "vocab_size": model.vocab_size}
    if diff:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)} vs config {now.get(k)}" for k in diff)
        raise CheckpointError(f"{path} is for a different model ({detail})")
    changed = {k: (saved.get(k), now.get(k)) for k in SOFT_KEYS if saved.get(k) != now.get(k)}
    for k, v in (run_facts or {}).items():
        if meta.get(k) is not None and meta[k] != v:
            changed[k] = (meta[k], v)
    import torch.distributed as dist

    quiet = dist.is_initialized() and dist.get_rank() != 0
    for k, (old, new) in ({} if quiet else changed).items():
        log.warning("resuming %s with %s changed: %s -> %s", path.name, k, old, new)


# the corpus facts a checkpoint's meta records (training.session); a resume that sees one changed warns
DATA_FACTS = ("documents", "tokens", "packed", "train_samples_per_epoch")


def _check_data(path: Path, meta: dict, data_info: dict | None) -> None:
    """Refuse a resume whose tokenizer differs from the checkpoint's (token ids would change meaning);
    warn when the corpus or its sampling differs (documents, tokens, packing, samples per epoch), which
    may be meant (a new data mixture)."""
    if not data_info:
        return
    import hashlib

    from .manager import TOKENIZER

    def digest(d) -> str | None:
        f = Path(d) / "tokenizer.json" if d else None
        return hashlib.sha256(f.read_bytes()).hexdigest() if f is not None and f.is_file() else None

    saved, now = digest(path / TOKENIZER), digest(data_info.get("tokenizer_dir"))
    if saved and now and saved != now:
        raise CheckpointError(
            f"{path} was trained with another tokenizer (its {TOKENIZER}/ differs from "
            f"{data_info.get('tokenizer_dir')}): token ids would change meaning; resume with "
            f"mt3d.data.tokenizer={path / TOKENIZER}"
        )
    was = meta.get("data") or {}
    changed = [k for k in ("corpus", *DATA_FACTS) if k in was and was[k] != data_info.get(k, was[k])]
    quiet = dist_rank() != 0
    if changed and not quiet:
        log.warning("resuming %s with another corpus (%s changed): the data order continues from step %s",
                    path.name, ", ".join(changed), meta.get("step"))  # fmt: skip


def dist_rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def check_lora(path: Path, meta: dict, lora: dict | None) -> None:
    """Refuse to resume a LoRA checkpoint into a run without LoRA or with other adapters (r, alpha,
    targets), or onto another base (its fingerprint, ``mt3d.model.peft.fingerprint``), and a full
    checkpoint into a LoRA run: adapters and base would not match what was trained."""
    saved = meta.get("lora")
    if (saved is None) != (lora is None):
        what = "a LoRA run's (adapters only)" if saved else "a full run's"
        has = "has" if lora else "has no"
        raise CheckpointError(f"{path} is {what} checkpoint; this run {has} mt3d.lora: resume it with the "
                              "run's own config, or start a new save_dir")  # fmt: skip
    if saved is None:
        return
    for key in ("r", "alpha", "rslora", "target_modules"):
        if saved.get(key) != lora.get(key):
            raise CheckpointError(
                f"{path} holds adapters with {key}={saved.get(key)!r}, this run asks "
                f"for {lora.get(key)!r}: use the checkpoint's mt3d.lora, or a new save_dir"
            )
    same = saved.get("fingerprint") == lora.get("fingerprint")
    if not same and lora.get("base") and not str(saved.get("fingerprint")).startswith(FULL):
        same = same_base(saved.get("fingerprint"), lora["base"])  # recorded before whole-file fingerprints
    if not same:
        raise CheckpointError(
            f"{path} holds adapters trained on another base (fingerprint of "
            f"{saved.get('base')} differs from {lora.get('base')}'s): use that base"
        )


def plan_resume(
    resume: str, save_dir: str | Path, model: ModelConfig, run_facts: dict | None = None,
    data_info: dict | None = None, lora: dict | None = None,
) -> ResumePlan | None:  # fmt: skip
    """The verified checkpoint to resume from (collective: every rank hashes a share of the files).

    With ``auto`` a checkpoint whose files do not match their manifest (bit flip, truncation) is
    reported and skipped in favour of the next older complete one; an explicit path must verify.
    """
    for path in candidates(resume, save_dir):
        manifest = read_manifest(path)
        _check_model(path, manifest["meta"], model, run_facts)
        _check_data(path, manifest["meta"], data_info)
        check_lora(path, manifest["meta"], lora)
        plan = ResumePlan(path, manifest["meta"], manifest)
        try:
            verify_everywhere(plan.path, plan.manifest)
        except CheckpointError as e:
            if resume != "auto":
                raise
            log.error("resume auto: skipping %s: %s", path, e)
            continue
        check_engine_state(plan.path, plan.meta)
        check_layer_files(plan.path, plan.manifest, model)
        return plan
    return None


LAYER_FILE = re.compile(r"^layer_(\d+)-model_(\d+)-model_states\.pt$")


def check_layer_files(path: Path, manifest: dict, model: ModelConfig) -> None:
    """Every pipeline layer file holds what the saved layout puts there, checked from the files' indexes
    (memory-mapped: no weight is read) before DeepSpeed loads any: each parameter's shard shape, and
    under expert parallelism only the experts of the file's ep rank (a file copied between ep ranks
    or rewritten with the wrong shape, its manifest re-hashed, would otherwise stop one rank in a raw
    error and the others in a collective). Collective: each rank checks a share, every rank raises
    the first problem found."""
    import torch.distributed as dist

    from ..ds.safe import safe_torch_load
    from ..model.moe import expert_index
    from ..model.sharding import shard_shape, sharding_table, split_name
    from ..parallel.axes import expert_layout

    layout = manifest["meta"].get("layout") or {}
    tp, ep = int(layout.get("tp", 1)), int(layout.get("ep", 1))
    experts = expert_layout({"tp": tp, "dp": int(layout.get("dp", 1)), **layout})
    vocab = int(manifest["meta"].get("vocab_size") or model.vocab_size or 1)
    specs = {split_name(n): spec for n, spec in sharding_table(model, vocab).items()}
    per_rank = model.moe_spec.experts // ep if model.moe_spec is not None else 0
    names = sorted(n for n in manifest["files"] if LAYER_FILE.match(n))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    problem = None
    for name in names[rank::world]:
        layer, model_rank = (int(g) for g in LAYER_FILE.match(name).groups())
        e = experts.expert_coordinates(model_rank)[0]
        for key, tensor in safe_torch_load(path / name, mmap=True).items():
            j = expert_index(key)
            if j is not None and ep > 1 and not e * per_rank <= j < (e + 1) * per_rank:
                held = f"{e * per_rank}-{(e + 1) * per_rank - 1}"
                problem = (f"{path / name} holds expert {j}, but ep rank {e} of {ep} holds experts {held} "
                           "(files swapped between ep ranks?)")  # fmt: skip
                break
            spec = specs.get((layer, key))
            split = tp if j is None else experts.etp
            want = shard_shape(spec.shape, spec.layout, split) if spec is not None else None
            if spec is not None and tuple(tensor.shape) != want:
                problem = (f"{path / name}: {key} has shape {tuple(tensor.shape)}, the saved layout "
                           f"({'expert_tensor' if split != tp else 'tp'} {split}) needs {want}")  # fmt: skip
                break
        if problem:
            break
    found = [problem]
    if world > 1:
        found = [None] * world
        dist.all_gather_object(found, problem)
    first = next((p for p in found if p), None)
    if first:
        raise CheckpointError(f"{first}: the checkpoint does not match its layout; use another one")


ENGINE_STATE_FILES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def check_engine_state(path: Path, meta: dict) -> None:
    """Refuse a manifest that disagrees with the engine state it describes.

    The step, the samples seen and the layout are recorded twice: in the manifest (which mt3d
    reads to plan the resume: data position, scheduler, reshard) and in DeepSpeed's engine state
    (``global_steps``, ``global_samples``, ``dp_world_size``, ``mp_world_size`` = tp x pp, and
    mt3d's client state ``mt3d.step``). A manifest edited to claim another step or layout would
    resume the data at one step and the scheduler at another; the files it lists are hashed, but
    its own fields are not, so they are checked here against the hashed engine state.
    """
    from ..ds.safe import safe_torch_load

    name = next((n for n in ENGINE_STATE_FILES if (path / n).is_file()), None)
    if name is None:
        raise CheckpointError(f"{path} has no engine state file ({' or '.join(ENGINE_STATE_FILES)})")
    state = safe_torch_load(path / name)
    layout = meta.get("layout") or {}
    # DeepSpeed's axes: 'model' the lcm(tp, etp x ep) sets of weights of a stage, 'data' the ranks
    # holding each (tp x ep and dp / ep x cp before folding; mt3d.parallel.axes.deepspeed_sizes); the
    # regular engine (ZeRO-2/3) sees dp x cp and tp (mt3d's ParallelState is its mpu), and writes module
    # files for the pipeline grid's 'model' ranks (mt3d.ds.experts.zero_checkpoint_names)
    degrees = {a: int(layout.get(a, 1)) for a in NAMES}
    if "etp" in layout:  # a folded expert layout (parallel.expert_layout)
        degrees["etp"] = int(layout["etp"])
    ds = deepspeed_sizes(degrees)
    if not uses_pipeline_engine(SimpleNamespace(zero_stage=int(layout.get("zero_stage", 1)))):
        ds = {
            "pipe": degrees["pp"],
            "data": degrees["dp"] * degrees["cp"],
            "model": ds["model"],
        }
    per_sample = ds["data"] / max(1, degrees["dp"])
    claims = {
        "step": (meta.get("step"), state.get("global_steps")),
        "step (mt3d client state)": (meta.get("step"), (state.get("mt3d") or {}).get("step")),
        "samples seen": (
            int(meta.get("step", 0) * meta.get("global_batch", 0) * per_sample)
            if meta.get("global_batch")
            else None,
            state.get("global_samples") if meta.get("global_batch") else None,
        ),
        "dp": (ds["data"], state.get("dp_world_size")),
        "tp x pp": (ds["model"] * ds["pipe"], state.get("mp_world_size")),
    }
    for what, (manifest_says, engine_says) in claims.items():
        if manifest_says != engine_says:
            raise CheckpointError(
                f"{path}/manifest.json says {what} {manifest_says} but the engine state ({name}) says "
                f"{engine_says}: the manifest was edited or belongs to another checkpoint; use another one"
            )


def restore(engine, plan: ResumePlan, load_dir: Path, tag: str, rt, same_layout: bool) -> dict:
    """Load engine state from ``load_dir/tag`` and this rank's RNG; returns DeepSpeed's client state.

    Random state belongs to a (pp, dp, tp) coordinate, so it is restored only when the degrees are
    unchanged (the rank order may differ); after a reshard every rank keeps its freshly seeded streams.
    """
    from contextlib import nullcontext

    from ..ds.experts import loading
    from ..ds.universal import own_group_settings

    accept_adam_states_across_implementations(engine)
    own = nullcontext() if same_layout else own_group_settings(engine)
    with loading(engine, rt.state, universal=not same_layout), own:
        path, client = engine.load_checkpoint(
            str(load_dir),
            tag=tag,
            load_optimizer_states=True,
            load_lr_scheduler_states=True,
            load_module_strict=not has_frozen(engine.module),  # a LoRA checkpoint holds the adapters only
        )
    if path is None:
        raise CheckpointError(f"DeepSpeed could not load {load_dir / tag}")
    if not same_layout:
        steps_as_their_optimizer_keeps_them(engine)
    from ..ds.nvme import finish_nvme_resume

    finish_nvme_resume(engine, Path(load_dir), tag)
    if not same_layout:
        restore_unoptimized(engine.module, plan.path)
    _check_finite(engine.module, load_dir / tag)
    key = rng_key(rt.state)
    if same_layout and not load_rng(plan.path, key, rt.tracker):
        log.warning("%s has no random state for %s: keeping the seeded one", plan.path, key)
    return client or {}


def restore_unoptimized(module, path: Path) -> None:
    """After a reshard (DeepSpeed's universal format holds what the optimizer trains): the parameters
    trained outside it (routers' correction biases, replicated) read from the source checkpoint."""
    import torch

    from .reader import CheckpointReader

    names = [(n, p) for n, p in module.named_parameters() if getattr(p, "mt3d_balance", False)]
    if names:
        reader = CheckpointReader(path, verify=False)
        with torch.no_grad():
            for name, p in names:
                p.copy_(reader.full(name))


def _check_finite(module, path: Path) -> None:
    """Refuse, on every rank and naming the weight (and its expert and rank), a checkpoint whose loaded
    weights hold NaN or infinite values (a damaged or diverged save): the first bad one of every rank
    is gathered, so no rank goes on into a step the others left. Collective."""
    import torch.distributed as dist

    from .loading import nonfinite, weight_name

    mine = next((f"{weight_name(n)} holds {bad}" for n, p in module.named_parameters()
                 if (bad := nonfinite(p.detach()))), None)  # fmt: skip
    found = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, mine)
    bad = [(rank, what) for rank, what in enumerate(found) if what]
    if bad:
        rank, what = bad[0]
        raise CheckpointError(f"{path}: on rank {rank}, {what}: the checkpoint is damaged or diverged; "
                              "resume an earlier one")  # fmt: skip
