"""Compiled sublayers under DDP (issue 39, part 3), on 2 real gloo ranks.

The trainer compiles each sublayer class's forward (nagmoe/train/speed.py `compile_model`) and, on more than one
rank, wraps the model in DistributedDataParallel (nagmoe/parallel/grad_sync.py `wrap_ddp`). The compiled
forwards then run inside DDP's forward, where dynamo hands every graph it compiles to its DDP optimizer
(`torch._dynamo.config.optimize_ddp`, on by default): it splits a graph at the boundaries of DDP's gradient
buckets, counted over the graph's parameters in reverse order, the last bucket (DDP's first) at 1 MiB
(`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`), the others at the DDP module's `bucket_bytes_cap`
(`wrap_ddp` keeps DDP's 25 MiB), and compiles each piece on its own (with `aot_eager`: one AOT graph each).

So a graph splits once it holds more than 1 MiB of parameters. At the micro width (d_model 32: 16 KB of
attention weights) nothing would; here the micro model is widened to d_model 384 with MHA: the attention graph
holds 4 x 384^2 fp32 = 2.36 MB and splits in two (c_q + c_proj | c_k + c_v, 1.18 MB each); the FFN graph (the
router, 6 KB) and the MoE's graph resumed after its eager expert call (fp32 grouped experts on the CPU break
the graph; no parameters) stay whole: 3 dynamo graphs, 4 AOT graphs, all compiled at step 1.

Checked on each rank, 3 Trainer steps (2 micro-steps each: DDP's `no_sync` on the first), fp32, activation
checkpointing on (the compiled forward re-runs in the backward, outside DDP's forward), compiled (`aot_eager`)
against the same steps eager:
  * losses and final parameters equal within 1e-5 absolute, AdamW's eps raised to 1e-3 in both runs (TOL's
    comment; at eps 1e-10 the embedding differed by 1.8e-6 to 3.3e-6 across ATEN_CPU_CAPABILITY: AdamW's
    amplified rounding, 2e-8 elsewhere; with the DDP optimizer off 2.0e-6 and the same losses: the split moves
    rounding only), and the ranks' parameters agree bitwise (DDP synchronised them);
  * the DDP optimizer compiled every dynamo graph, with DDP's module active and its bucket cap, and split the
    attention graph (one AOT graph per bucket);
  * no graph is added after step 2 (nor after step 1).
Broken by hand, it fails: with `optimize_ddp = False` in the ranks (no DDP optimizer compile), with a
`torch._dynamo.reset()` before step 3 (a recompile: 6 graphs), with rank 1's compiled graphs offset by 1e-4.
"""
import functools
import os

import numpy as np
import pytest

from gloo_ranks import run_on_ranks
from test_parallel_training import COMPARE_ADAMW_EPS, adamw_eps_of, compare_adamw_eps

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 3
# fp32 summation-order rounding only (aot_eager runs the eager kernels). AdamW turns a nearly cancelled gradient
# element's rounding into an update difference up to O(lr), so both runs build it with test_parallel_training.py's
# COMPARE_ADAMW_EPS (its TOL comment: |Δθ| <= 2.04·Σ_t lr_t·max|δg|/ε; here max|δg| <= 1e-9 measured, 3 steps,
# lr <= 0.02: <= 1.2e-7 on any CPU)
TOL = 1e-5
WIDE = ("model.attention.kind=mha", "model.d_model=384", "model.attention.n_heads=4", "train.micro_batch_tokens=64",
        "train.activation_checkpointing=true", "train.lr_embed=0.02", f"train.max_steps={STEPS}")
FIRST_BUCKET_BYTES = 1024 * 1024  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def _steps(overrides, run_dir, compiled):
    from torch._dynamo.utils import counters

    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"),
                      [*overrides, f"train.compile={'true' if compiled else 'false'}"])
    trainer = Trainer(cfg, run_dir, quiet=True)
    assert trainer.ddp is not None and trainer.accum == 2 and adamw_eps_of(trainer) == {COMPARE_ADAMW_EPS}
    losses, graphs = [], []
    for _ in range(STEPS):
        losses.append(trainer.train_step()["loss"])
        graphs.append((counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]))
    out = {"losses": losses, "graphs": graphs, "compile": trainer.backends["compile"],
           "bucket_bytes_cap": trainer.ddp.bucket_bytes_cap,
           "params": {n: p.detach().numpy().copy() for n, p in trainer.model.named_parameters()}}
    trainer.release_lease()
    return out


def _rank(overrides, tmp):
    """Eager, then compiled (aot_eager), with dynamo's DDP optimizer watched: what each of its compilations
    saw (DDP's module active, the bucket caps) and the buckets it made."""
    import torch._dynamo
    from torch._dynamo.backends.distributed import DDPOptimizer
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel

    import nagmoe.train.trainer as trainer_module
    from nagmoe.train.speed import compile_model

    os.environ.pop("NAGMOE_CUDA_RULES", None)  # fp32: no CUDA autocast rules on the CPU
    torch._dynamo.reset()
    counters.clear()
    splits = []
    compile_fn = DDPOptimizer.compile_fn

    def watched(self, gm, example_inputs, **kwargs):
        compiled = compile_fn(self, gm, example_inputs, **kwargs)
        ddp = DistributedDataParallel._get_active_ddp_module()
        splits.append({"ddp_cap": None if ddp is None else ddp.bucket_bytes_cap, "cap": self.bucket_bytes_cap,
                       "first_cap": self.first_bucket_cap,
                       "buckets": [(b.size, [p.split("_parameters_")[0].removeprefix("L_self_modules_")
                                             for p in b.params]) for b in self.buckets]})
        return compiled

    DDPOptimizer.compile_fn = watched
    trainer_module.compile_model = functools.partial(compile_model, backend="aot_eager")  # this process only
    try:
        with compare_adamw_eps():  # TOL's comment
            eager = _steps(overrides, os.path.join(tmp, "eager"), compiled=False)
            compiled = _steps(overrides, os.path.join(tmp, "compiled"), compiled=True)
    finally:
        DDPOptimizer.compile_fn = compile_fn
        trainer_module.compile_model = compile_model
        torch._dynamo.reset()
    return {"eager": eager, "compiled": compiled, "splits": splits}


def test_compiled_sublayers_under_ddp_equal_eager_without_recompiles(micro_overrides, tmp_path):
    results = run_on_ranks(_rank, 2, [*micro_overrides, *WIDE], str(tmp_path), timeout=240)
    for rank, r in enumerate(results):
        eager, compiled, splits = r["eager"], r["compiled"], r["splits"]
        print(f"\nrank {rank}: losses eager {eager['losses']} compiled {compiled['losses']}; (dynamo graphs, AOT "
              f"graphs) per step {compiled['graphs']}; DDP optimizer buckets per graph "
              f"{[s['buckets'] for s in splits]}")
        assert compiled["compile"] == "sublayers (MultiHeadAttention, MoELayer), aot_eager"
        assert eager["graphs"] == [(0, 0)] * STEPS  # the reference really ran eagerly
        # equal to the eager steps
        np.testing.assert_allclose(compiled["losses"], eager["losses"], rtol=0, atol=TOL)
        assert compiled["params"].keys() == eager["params"].keys()
        for name, want in eager["params"].items():
            np.testing.assert_allclose(compiled["params"][name], want, rtol=0, atol=TOL, err_msg=name)
        # no recompiles in the steady state
        (graphs, aot_graphs), after_2, after_3 = compiled["graphs"][0], compiled["graphs"][1], compiled["graphs"][2]
        assert after_3 == after_2 == compiled["graphs"][0], f"recompiled: {compiled['graphs']}"
        # the DDP optimizer compiled every dynamo graph, inside DDP's forward, with DDP's bucket caps (the
        # sublayers' three and the loss's chunk, issue 60: no parameter inside, the head's weight an input) ...
        assert len(splits) == graphs == 4, splits
        for s in splits:
            assert s["ddp_cap"] == s["cap"] == compiled["bucket_bytes_cap"], s
            assert s["first_cap"] == FIRST_BUCKET_BYTES
        # ... and split the attention graph at a bucket boundary: one AOT graph per bucket
        split = [s["buckets"] for s in splits if len(s["buckets"]) > 1]
        assert len(split) == 1 and len(split[0]) == 2, splits
        assert sorted(n for _, names in split[0] for n in names) == ["c_k", "c_proj", "c_q", "c_v"], splits
        assert aot_graphs == sum(len(s["buckets"]) for s in splits) == graphs + 1
    # the ranks agree: the same global losses, bitwise equal (DDP-synchronised) parameters
    assert results[0]["compiled"]["losses"] == results[1]["compiled"]["losses"]
    for name, value in results[0]["compiled"]["params"].items():
        np.testing.assert_array_equal(value, results[1]["compiled"]["params"][name], err_msg=name)
