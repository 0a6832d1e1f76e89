"""nagmoe: MoE language-model pretraining with a norm-agnostic (NAG) residual stream."""

__version__ = "0.1.0"
