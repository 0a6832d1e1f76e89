"""Sampling from a trained run: the latest valid checkpoint and the run's tokenizer; the prompt is prefilled in
one forward pass, then tokens are decoded one at a time with the model's inference cache (KV, and CCA's conv
and value-shift state; see `Transformer.new_cache`).

The prompt is encoded as a training document starts: `<|bos|>` then its tokens (special-token text in the
prompt is ordinary text). Generation stops after `max_new_tokens` or at a sampled BOS (a new document).

Mixture-of-Depths runs decode with the thresholds saved in the checkpoint (every token decides from its own
rotation score, exactly as in the full forward); `set_skip_rate` moves the dial to another rate using the
saved per-sublayer score histograms.
"""
from __future__ import annotations

import os
from typing import NamedTuple, Optional

import torch

from nagmoe.base.errors import UserError


class LoadedRun(NamedTuple):
    model: "torch.nn.Module"
    tokenizer: object  # tokenizers.Tokenizer
    bos_id: int
    config: object  # nagmoe.config.Config
    checkpoint: str


def load_run(run_dir: str, device: str = "cpu", checkpoint: Optional[str] = None) -> LoadedRun:
    """Model (eval mode, on `device`) from the run's latest valid checkpoint (or `checkpoint`), and its
    tokenizer; UserError when the run dir, its config, a checkpoint or the tokenizer is missing."""
    from nagmoe.data.tokenizer import bos_id, check_vocab, load_tokenizer
    from nagmoe.model import build_model
    from nagmoe.checkpoint import latest_valid_checkpoint, load_model_weights
    from nagmoe.rundir.info import CONFIG_FILE, read_saved_config

    if not os.path.isdir(run_dir):
        raise UserError(f"--run-dir: {run_dir} is not a directory")
    cfg = read_saved_config(run_dir)
    if cfg is None:
        raise UserError(f"--run-dir: {run_dir} is not a run dir (no {CONFIG_FILE})")
    verified = checkpoint is None  # latest_valid_checkpoint verifies; a checkpoint given is verified on load
    checkpoint = checkpoint or latest_valid_checkpoint(run_dir)
    if checkpoint is None:
        raise UserError(f"--run-dir: {run_dir} has no valid checkpoint under checkpoints/ (train it first)")
    tok_path = os.path.join(cfg.data.data_dir, "tokenizer.json")
    tokenizer = load_tokenizer(tok_path)
    check_vocab(tokenizer, cfg.model.vocab_size, tok_path)
    _check_tokenizer_matches_data(cfg.data.data_dir, tok_path)
    tokenizer.encode_special_tokens = True  # as the training documents were encoded
    model = build_model(cfg.model)
    model.set_mod_seq_len(cfg.data.seq_len)  # MoD's work weights as in training
    model.set_precision(cfg.train.precision)  # the run's numerics (legacy for run dirs from before the key)
    load_model_weights(checkpoint, model, verified=verified)  # either engine's layout
    return LoadedRun(model.to(device).eval(), tokenizer, bos_id(tokenizer, tok_path), cfg, checkpoint)


def _check_tokenizer_matches_data(data_dir: str, tok_path: str) -> None:
    """Same vocabulary size is not enough: the tokenizer must be the file the training data was tokenised
    with (its sha256 is recorded in the data index); a swapped tokenizer would decode garbage silently."""
    from nagmoe.data import shards
    from nagmoe.data.tokenizer import file_sha256

    if not os.path.isfile(os.path.join(data_dir, shards.INDEX)):
        return  # data removed after training: the vocabulary check above is all we can do
    expected = shards.read_index(data_dir).get("tokenizer_sha256")
    if expected and file_sha256(tok_path) != expected:
        raise UserError(f"{tok_path}: not the tokenizer this run's data was made with (sha256 differs from "
                        f"{os.path.join(data_dir, shards.INDEX)}); restore it or re-prepare the data")


CALIBRATION_TOKENS = 16384  # validation tokens the dial calibrates on


def set_skip_rate(run: LoadedRun, rate: float, tokens: int = CALIBRATION_TOKENS) -> Optional[dict]:
    """Thresholds that realise skip rate `rate` (MoD runs only; SkipRateUnavailable otherwise): read from the run's
    score histograms, then calibrated by a few fixed-point passes on up to `tokens` validation tokens
    (nagmoe.model.mod_calibration.calibrate_skip_rate). Returns the calibration (None when the run's
    validation split is gone: then the histogram quantiles are used as they are)."""
    from nagmoe.model.mod_calibration import calibrate_skip_rate
    from nagmoe.data import shards
    from nagmoe.data.loader import TokenShards, iter_eval_batches

    run.model.set_mod_skip_rate(rate)  # refuses a model without MoD before any data is read
    data_dir = run.config.data.data_dir
    if not os.path.isfile(os.path.join(data_dir, shards.INDEX)):
        return None
    val = TokenShards(data_dir, "val", verify=run.config.data.verify_shards)
    device = next(run.model.parameters()).device
    seq_len = run.config.data.seq_len
    batches = list(iter_eval_batches(val, seq_len, max(1, 4096 // seq_len), max_tokens=tokens))

    @torch.no_grad()
    def forwards():
        for x_BT, _ in batches:
            run.model(x_BT.to(device))

    out = calibrate_skip_rate(run.model, rate, forwards)
    out["tokens"] = sum(x.numel() for x, _ in batches)
    return out


def mod_report(run: LoadedRun, dial: Optional[dict] = None) -> Optional[str]:
    """One line on the skipping of the forwards so far (None for a model without MoD or before any), with the
    dial's request and its calibration when one was set."""
    mod = run.model.mod_calibrator()
    rate = mod.inference_skip_rate() if mod is not None else None
    if rate is None:
        return None
    line = f"MoD: skipped {rate:.1%} of eligible sublayer work"
    if dial is None:
        return line + f" (thresholds for skip rate {mod.skip_rate:g})"
    return line + (f" (asked {dial['requested']:.1%}; calibrated to {dial['calibrated']:.1%} on {dial['tokens']:,} "
                   f"validation tokens in {dial['passes']} passes)")


def sample_next(logits_BV: torch.Tensor, temperature: float, top_k: Optional[int],
                generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next token ids (B,): argmax for temperature 0, else softmax(logits / temperature) restricted to the
    top_k logits (None or 0 = all)."""
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    logits_BV = logits_BV.float() / temperature
    if top_k and top_k < logits_BV.shape[-1]:
        kth_B1 = logits_BV.topk(top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth_B1, float("-inf"))
    probs_BV = torch.softmax(logits_BV, dim=-1)
    return torch.multinomial(probs_BV, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate_ids(model, prompt_ids: list[int], max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 stop_id: Optional[int] = None, use_cache: bool = True) -> list[int]:
    """The new token ids after `prompt_ids` (one sequence). With `use_cache` the prompt is prefilled once and
    each new token costs one single-token forward; without it every step reruns the whole sequence (the
    reference the cache is tested against)."""
    if not prompt_ids:
        raise ValueError("generate_ids: the prompt needs at least one token")
    device = next(model.parameters()).device
    ids_BT = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    cache = model.new_cache(len(prompt_ids) + max_new_tokens) if use_cache else None
    new: list[int] = []
    step_input_BT = ids_BT
    for _ in range(max_new_tokens):
        logits_BTV = model(step_input_BT if use_cache else ids_BT, cache=cache).logits
        next_B = sample_next(logits_BTV[:, -1], temperature, top_k, generator)
        token = int(next_B.item())
        if stop_id is not None and token == stop_id:
            break
        new.append(token)
        step_input_BT = next_B.view(1, 1)
        ids_BT = torch.cat([ids_BT, step_input_BT], dim=1)
    return new


def generate_text(run: LoadedRun, prompt: str, max_new_tokens: int = 64, temperature: float = 0.8,
                  top_k: Optional[int] = 50, seed: int = 0) -> str:
    """The completion of `prompt` (decoded text of the new tokens only)."""
    prompt_ids = [run.bos_id, *run.tokenizer.encode(prompt, add_special_tokens=False).ids]
    limit = run.config.model.max_seq_len
    if len(prompt_ids) + max_new_tokens > limit:
        raise UserError(f"--prompt: {len(prompt_ids)} prompt tokens (with BOS) + --max-new-tokens "
                        f"{max_new_tokens} exceed the model's max_seq_len {limit}")
    device = next(run.model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    new = generate_ids(run.model, prompt_ids, max_new_tokens, temperature, top_k, generator, stop_id=run.bos_id)
    return run.tokenizer.decode(new, skip_special_tokens=False)
