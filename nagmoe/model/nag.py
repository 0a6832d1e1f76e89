"""The pure NAG math of the model (the contract names `nagmoe.model.nag.nag_update`, `modulator`,
`rotation_score`). The equations live in nagmoe/ops/nag_math.py, below both the model and the fused op
(nagmoe/ops/nag_fused.py), so a kernel never depends on a layer; they are the fused op's test oracle."""
from nagmoe.ops.nag_math import branch_direction, modulator, nag_update, rms_normalise, rotation_score

__all__ = ["branch_direction", "modulator", "nag_update", "rms_normalise", "rotation_score"]
