"""What each model family does with every key of an HF config that transformers' modeling code reads.

A key is *read* (mt3d honours it: it becomes part of the ModelConfig, or is checked to be the one
value mt3d implements; its type is checked here), *inert* (it cannot change the computed function:
token ids, caching, output flags, classification heads, the attention kernel), or *refused* (it
switches on a feature mt3d does not implement: refused by name unless it has a value that leaves the
feature off). tests/test_hf.py reads every key transformers' modeling file of a family reads and
checks that the family's table lists it, so a transformers upgrade that starts reading a new key is
noticed instead of silently diverging.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

READ, INERT, REFUSED = "read", "inert", "refused"

KINDS = {
    "int+": ("a positive integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0),
    "int0+": ("a non-negative integer", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0),
    "num+": ("a positive number", lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v > 0),
    "num0+": (
        "a non-negative number",
        lambda v: isinstance(v, int | float) and not isinstance(v, bool) and v >= 0,
    ),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "list": ("a list", lambda v: isinstance(v, list)),
    "strs": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "any": ("anything", lambda v: True),
}


@dataclass(frozen=True)
class Key:
    """How a family treats one HF config key."""

    role: str
    kind: str = "any"
    """READ keys: the type a non-null value must have (``KINDS``)."""
    note: str = ""
    """INERT: why it cannot change the function; REFUSED: the feature it switches on."""
    off: tuple = (None, False, 0)
    """REFUSED keys: the values that leave the feature off."""


def read(kind: str = "any") -> Key:
    """A key mt3d honours (a non-null value must be of ``kind``)."""
    return Key(READ, kind)


def inert(why: str) -> Key:
    """A key that cannot change the computed function, and why."""
    return Key(INERT, note=why)


def refused(feature: str, *off: Any) -> Key:
    """A key that switches on ``feature`` unless it is one of ``off`` (default: null, false, 0)."""
    return Key(REFUSED, note=feature, off=off or (None, False, 0))


_IDS = inert("a token id: not part of the computed function")
_HEAD = inert("used by classification heads, not by the causal language model")
_OUTPUT = inert("what the forward returns, not what it computes")
COMMON: dict[str, Key] = {
    "_attn_implementation": inert("the attention kernel: the same function"),
    "attn_implementation": inert("the attention kernel: the same function"),
    "pad_token_id": _IDS,
    "bos_token_id": _IDS,
    "eos_token_id": _IDS,
    "use_cache": inert("caching of keys and values during generation"),
    "output_attentions": _OUTPUT,
    "output_hidden_states": _OUTPUT,
    "return_dict": _OUTPUT,
    "num_labels": _HEAD,
    "problem_type": _HEAD,
    "classifier_dropout": _HEAD,
    "id2label": _HEAD,
    "label2id": _HEAD,
    "dtype": inert("the stored dtype: mt3d reads each tensor's own and computes in its precision"),
    "torch_dtype": inert("the stored dtype: mt3d reads each tensor's own and computes in its precision"),
    "initializer_range": read("num0+"),  # the init of new weights only
    "architectures": read("strs"),
    "model_type": read("str"),
    "vocab_size": read("int+"),
    "tie_word_embeddings": read("bool"),
    "rope_parameters": read("dict"),
    "rope_scaling": read("dict"),
    "rope_theta": read("num+"),
    "num_local_experts": refused("mixture-of-experts layers"),
    "num_experts": refused("mixture-of-experts layers"),
    "n_routed_experts": refused("mixture-of-experts layers"),
    "moe_intermediate_size": refused("mixture-of-experts layers"),
    "num_experts_per_tok": refused("mixture-of-experts layers"),
    "scoring_func": refused("sigmoid expert scoring (DeepSeek-V3 routing)", None, "softmax"),
    "topk_method": refused("grouped or biased expert selection (DeepSeek routing)", None, "greedy"),
    "n_group": refused("grouped expert routing (DeepSeek-V3)", None, 0, 1),
    "topk_group": refused("grouped expert routing (DeepSeek-V3)", None, 0, 1),
    "routed_scaling_factor": refused("scaled routed-expert outputs (DeepSeek)", None, 1, 1.0),
    "attention_sinks": refused("attention sinks"),
    "attention_sink_size": refused("attention sinks"),
    "num_attention_sinks": refused("attention sinks"),
    "sink_tokens": refused("attention sinks"),
    "use_bidirectional_attention": refused("bidirectional attention"),
    "attention_chunk_size": refused("chunked attention"),
    "cross_attention_hidden_size": refused("cross attention"),
    "add_cross_attention": refused("cross attention"),
}
"""Keys every family treats alike."""

LLAMA_LIKE: dict[str, Key] = {
    "hidden_size": read("int+"),
    "intermediate_size": read("int+"),
    "num_hidden_layers": read("int+"),
    "num_attention_heads": read("int+"),
    "num_key_value_heads": read("int+"),
    "head_dim": read("int+"),
    "hidden_act": read("str"),
    "max_position_embeddings": read("int+"),
    "rms_norm_eps": read("num+"),
    "attention_dropout": read("num0+"),
}
"""Keys of the families that share Llama's config (each adds its own)."""

WINDOWED: dict[str, Key] = {
    "sliding_window": read("int+"),
    "layer_types": read("strs"),
}
"""The local-attention keys (window and per-layer types)."""


def check_keys(hf: dict, table: dict[str, Key], where: str, error) -> None:
    """Refuse (``error``, one line) a key that switches on a feature mt3d lacks, and a read key whose
    value has the wrong type. Keys outside the table are not read by transformers' modeling code."""
    for key, value in hf.items():
        spec = table.get(key)
        if spec is None:
            continue
        if spec.role == REFUSED and value not in spec.off:
            raise error(f"{where}: {key}={value!r} asks for {spec.note}, which mt3d does not implement")
        if spec.role == READ and value is not None:
            what, ok = KINDS[spec.kind]
            if not ok(value):
                raise error(f"{where}: config.json's {key} must be {what}, got {value!r}")
