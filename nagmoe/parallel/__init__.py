"""Parallelism applied from outside the single-device model (torchtitan's pattern).

  env.py              rank/world/master from torchrun or Slurm variables; NCCL on CUDA, gloo on CPU
  mesh.py             the (dp x ep) DeviceMesh, its groups, `parallel.*` validation, small collectives
  expert_parallel.py  expert sharding and the all-to-all token dispatcher (MoELayer.dispatcher)
  grad_sync.py        DDP for replicated parameters, expert-gradient reduction, the global gradient norm
"""
