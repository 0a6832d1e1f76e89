"""The trainer's validation evals (issue 66): bits per byte on the eval sample (nagmoe/data/eval_sample.py), split
over ranks, and at the final eval every window's losses kept in the run dir for paired comparisons
(nagmoe/eval/val_windows.py, nagmoe/analysis/paired.py).

Sizes: `train.eval_tokens` at the final eval (the last step, or the summary's eval of a run resumed at its stop),
`train.eval_tokens_during` (None = eval_tokens) at the in-loop evals every `train.eval_every` steps. The total is
summed per batch as before issue 66 (float32 per batch, `bpb_sums`), so a legacy run's number is unchanged to the
last bit; the kept windows sum each row in float64 and agree with it to ~1e-8 relative.
"""
from __future__ import annotations

import torch

from nagmoe.data.bpb import bits_per_byte, bpb_sums
from nagmoe.data.host_copy import to_device
from nagmoe.data.loader import iter_eval_windows
from nagmoe.eval.val_windows import WindowAccumulator, write_window_losses


@torch.no_grad()
def validation_bpb(trainer, final: bool) -> float:
    """Validation bits per byte of `trainer`'s model; under distributed training the val batches are split over
    ranks (batch k on rank k mod R) and the sums reduced. Under EP every forward is collective, so a rank out of
    batches runs a throw-away forward while others still have one."""
    t, seq_len = trainer.cfg.train, trainer.cfg.data.seq_len
    tokens = t.eval_tokens if final or t.eval_tokens_during is None else t.eval_tokens_during
    model, mesh = trainer.model, trainer.mesh
    model.eval()
    nats, nbytes = 0.0, 0
    batches = iter_eval_windows(trainer.val_shards, seq_len, trainer.micro_rows, max_tokens=tokens,
                                sample=t.eval_sample, rank=trainer.rank, world_size=trainer.world_size)
    windows = WindowAccumulator(trainer.token_bytes) if final else None
    lockstep = mesh.ep > 1
    while True:
        batch = next(batches, None)
        if lockstep and not mesh.any(batch is not None):
            break
        if batch is None:
            if not lockstep:
                break
            x = torch.zeros(1, seq_len, dtype=torch.long, device=trainer.device)
            with trainer.autocast:
                model(x, x, reduction="none")
            continue
        ids, x, y = batch[0], to_device(batch[1], trainer.device), to_device(batch[2], trainer.device)
        with trainer.autocast:
            out = model(x, y, reduction="none")
        n, b = bpb_sums(out.loss, y, trainer.token_bytes)
        nats, nbytes = nats + n, nbytes + b
        if windows is not None:
            windows.add(ids, out.loss, y)
    model.train()
    if mesh.distributed:
        nats, nbytes = mesh.all_reduce([nats, nbytes])
    if windows is not None:
        keep_window_losses(trainer, windows)
    return bits_per_byte(nats, nbytes)


def keep_window_losses(trainer, windows: WindowAccumulator) -> None:
    """Every rank's per-window sums gathered to rank 0 and written as RUN_DIR/eval_windows.json after the lease
    fence (a trainer that lost the run dir writes nothing)."""
    parts = [windows.columns()]
    if trainer.mesh.distributed:
        import torch.distributed as dist

        gathered = [None] * trainer.world_size if trainer.rank == 0 else None
        dist.gather_object(parts[0], gathered, dst=0)
        parts = gathered
    trainer.fence()
    if trainer.rank == 0:
        seq_len, shards = trainer.cfg.data.seq_len, trainer.val_shards
        write_window_losses(trainer.run_dir, WindowAccumulator.merge(
            parts, shards.fingerprint, seq_len, trainer.cfg.train.eval_sample, int(shards.window_starts(seq_len)[-1]),
            trainer.progress.step))
