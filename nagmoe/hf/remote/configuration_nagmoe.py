"""The Hugging Face configuration of a model exported from nagmoe (`nagmoe export-hf`). Self-contained.

`nagmoe_model` is the run's whole `model:` section as nagmoe saved it; `layout` the sizes the modeling code builds
(heads, head dim, rotary dims, hidden widths, MoD eligibility), computed by nagmoe's own rules at export so this
code never re-derives them; `seq_len` the run's training context (data.seq_len); `source` the run, step,
checkpoint hash and commit it came from. The standard names (`hidden_size`, `num_hidden_layers`,
`max_position_embeddings`, `num_attention_heads`) map onto nagmoe's through `attribute_map`.
"""
from __future__ import annotations

from transformers import PreTrainedConfig

FORMAT_VERSION = 1


class NagMoeConfig(PreTrainedConfig):
    model_type = "nagmoe"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
                     "max_position_embeddings": "max_seq_len", "num_attention_heads": "n_heads"}

    nagmoe_model: dict | None = None
    layout: dict | None = None
    seq_len: int = 256
    precision: str = "uniform"
    source: dict | None = None
    nagmoe_format: int = FORMAT_VERSION
    vocab_size: int = 4096
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    max_seq_len: int = 256
    residual: str = "nag"
    tie_word_embeddings: bool = False
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        model = self.nagmoe_model or {}
        for name in ("vocab_size", "d_model", "n_layers", "max_seq_len", "residual"):
            if name in model:
                setattr(self, name, model[name])
        if isinstance(model.get("attention"), dict) and "n_heads" in model["attention"]:
            self.n_heads = model["attention"]["n_heads"]
        super().__post_init__(**kwargs)
