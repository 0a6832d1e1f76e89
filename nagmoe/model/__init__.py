"""Single-device model code (no torch.distributed here). `build_model(config.model) -> Transformer`."""
from nagmoe.model.transformer import ModelOutput, Transformer, build_model

__all__ = ["ModelOutput", "Transformer", "build_model"]
