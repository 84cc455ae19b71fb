"""The planner's enumerated choices, in a module that imports nothing: the command-line parser reads
them at start-up, and commands such as ``mt3d preprocess`` run under memory caps without torch."""

ATTENTION_KERNELS = ("flash", "materialized")
"""How attention is computed: FlashAttention-style (no scores kept), or scores materialised and timed
as GEMMs (Megatron-LM 2021)."""

OPTIMIZER_STATES = ("fp32", "bf16-moments", "bf16")
"""The optimizer-state dtypes the planner can size (``costs.Precision.of``)."""

GRAD_DTYPES = ("param", "fp32")
"""Gradient dtypes the planner can size (``--grad-dtype``): the weights' (DeepSpeed's default, which
mt3d leaves), or fp32 beside 16-bit weights: Megatron-Core's default (its fp32 gradient buffer,
reduce-scattered in fp32), or mt3d's ``data_types.grad_accum_dtype: fp32`` (DeepSpeed's BF16 optimizer,
ZeRO-1 with bf16 only: the bf16 gradients stay allocated beside the fp32 buffer unless
``overlap.grad_reduce`` folds each in as it is produced; reduced in bf16)."""

RECOMPUTE = ("none", "full", "selective")
"""Recompute modes the planner tries: none, whole blocks (``Layout.recompute``), or the attention
core and the MLP's activation of every block (``Layout.selective``)."""

OVERLAPS = ("dp", "tp", "pp", "tp-comm", "ep")
"""Transfers the planner can count as overlapped with compute (``--overlap``): dp, the data-parallel
gradient reduction during the last micro-batch's backward (``mt3d.train.overlap.grad_reduce``); tp,
each column-parallel linear's backward transfers behind its GEMMs (what mt3d's layers always do:
the input gradient's all-reduce, or with sequence parallelism its reduce-scatter and the input
shard's all-gather); pp, pipeline transfers posted ahead of need (``mt3d.train.overlap.p2p``);
tp-comm, another stack's: every TP transfer of a sequence-parallel layout pipelined with the GEMM
beside it, forward and backward (Megatron-Core's --tp-comm-overlap; mt3d does not do it); ep, the
expert all-to-all pipelined with the routed experts in ``DISPATCH_CHUNKS`` chunks of each layer's
tokens (``mt3d.train.overlap.dispatch_chunks``)."""

DISPATCH_CHUNKS = 4
"""Chunks of each MoE layer's tokens the planner pipelines over the expert all-to-all with ``--overlap
ep`` (and writes as ``mt3d.train.overlap.dispatch_chunks``): all but one chunk's dispatch and combine
hide behind the routed experts' compute (``timing.dispatch_hidden``), for GEMMs of 1/4 the rows."""

DEFAULT_OVERLAP = ("tp",)
"""What ``mt3d plan`` counts as overlapped unless ``--overlap`` says otherwise: what mt3d always
overlaps (with ``--other-stack``, ``none``: nothing, as Megatron-LM 2021)."""

GRAD_BUCKET_ELEMENTS = 40_000_000
"""Gradient elements per overlapped bucket (``mt3d.train.overlap.bucket_elements``' default)."""
