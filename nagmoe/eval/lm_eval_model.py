"""lm-evaluation-harness on a native run: the registered model `nagmoe` (`--model nagmoe --model_args
run_dir=R[,batch_size=N,add_bos_token=...,checkpoint=P,device=D]`), scoring through nagmoe's reader and model.

It tokenises exactly as lm-eval's `hf` model does on an export of the same run (the export's tokenizer prepends
BOS, as nagmoe trains): `tok_encode` adds BOS unless `add_bos_token=False` or the call says otherwise, the
context/continuation split and the rolling windows are lm-eval's own (TemplateLM, utils.get_rolling_token_windows
with the BOS as the prefix token), so per-request log-likelihoods of the two agree to float rounding.
Rows are right-padded (causal attention: padding never reaches a scored position). generate_until: greedy, one
request at a time with the inference cache, stopped at BOS or any `until` string.

For loglikelihood_rolling pass `add_bos_token=False` (both here and to `hf`): lm-eval then prefixes each
document's first window with the BOS itself, which is nagmoe's document start; with BOS added by the tokenizer
the BOS would be scored as a first token after a BOS.

lm-eval's own command line finds this model through `python -m nagmoe.eval.lm_eval_cli` (nagmoe/eval/lm_eval_cli.py);
`nagmoe eval --lm-eval` passes `--model-args` through `parse_model_args`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import lm_eval.models  # noqa: F401  (lm-eval fills its registry only while empty: keep `hf` & co. findable)
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval import utils as lm_utils

from nagmoe.base.errors import UserError, shown

# model_args `nagmoe eval --model-args` passes on (run_dir, batch_size and device are its own options)
MODEL_ARGS = ("add_bos_token", "max_length", "checkpoint")
# what lm-eval's command line may add to any model's arguments; meaningless here (nagmoe runs its own code)
IGNORED_ARGS = ("max_batch_size", "trust_remote_code")
OWN_OPTIONS = {"run_dir": "--run-dir", "batch_size": "--batch-size", "device": "--device"}


def parse_model_args(text: str) -> dict:
    """`K=V[,K=V...]` of `nagmoe eval --model-args` as NagmoeLM keyword arguments (values stay text)."""
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UserError(f"--model-args: {shown(item)} is not key=value")
        key = key.strip()
        if key in OWN_OPTIONS:
            raise UserError(f"--model-args: give {key} as {OWN_OPTIONS[key]}")
        if key not in MODEL_ARGS:
            raise UserError(f"--model-args: unknown key {shown(key)} (known: {', '.join(MODEL_ARGS)})")
        out[key] = value.strip()
    _flag(out.get("add_bos_token"))
    _length(out.get("max_length"))
    return out


def bos_convention(add_bos_token) -> str:
    """How a loglikelihood_rolling task scores each document's start under `add_bos_token`."""
    if _flag(add_bos_token) is False:
        return "add_bos_token=False (lm-eval prefixes the BOS itself)"
    return ("add_bos_token=True (the tokenizer's BOS is scored after lm-eval's; add_bos_token=False scores from "
            "nagmoe's document start)")


def _flag(value) -> Optional[bool]:
    if value is None or isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise UserError(f"lm-eval model_args add_bos_token: {shown(value)} is not true or false")


def _length(value) -> Optional[int]:
    if value is None or value == "":
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise UserError(f"lm-eval model_args max_length: {shown(value)} is not a positive integer")
    return n


def _device(device: str) -> str:
    # lm-eval's command line defaults to cuda:0; say so in one line rather than fail deep in torch
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"lm-eval model nagmoe: device {shown(device)} but no CUDA device is visible "
                        "(pass --device cpu)")
    return str(device)


@register_model("nagmoe")
class NagmoeLM(TemplateLM):
    def __init__(self, run_dir: str = None, checkpoint: Optional[str] = None, batch_size=1, device: str = "cpu",
                 add_bos_token=None, max_length: Optional[int] = None, **kwargs):
        super().__init__()
        unknown = [k for k in kwargs if k not in IGNORED_ARGS]
        if unknown:  # a misspelt add_bos_token must not be dropped silently
            raise UserError(f"lm-eval model nagmoe: unknown model_args key {shown(unknown[0])} "
                            f"(known: run_dir, batch_size, device, {', '.join(MODEL_ARGS)})")
        if not run_dir:
            raise UserError("lm-eval model nagmoe: model_args needs run_dir=DIR")
        from nagmoe.eval.generate import load_run

        self.add_bos_token = _flag(add_bos_token)
        device = _device(device)
        self.run = load_run(str(run_dir), device, checkpoint or None)
        self.model = self.run.model
        self.tokenizer = None  # no chat template (TemplateLM.chat_template reads this)
        self.bos = self.run.bos_id
        self.batch_size = int(batch_size) if not str(batch_size).startswith("auto") else 8  # auto[:N]: 8
        self._max_length = _length(max_length) or self.run.config.model.max_seq_len
        self._device = torch.device(device)

    # ---------------------------------------------------------------------------------------- tokenisation
    @property
    def eot_token_id(self) -> int:
        return self.bos

    @property
    def prefix_token_id(self) -> int:
        return self.bos

    @property
    def max_length(self) -> int:
        return self._max_length

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs) -> list[int]:
        add = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        ids = self.run.tokenizer.encode(string, add_special_tokens=False).ids
        return [self.bos, *ids] if add is not False else ids

    def tok_decode(self, ids) -> str:
        return self.run.tokenizer.decode(list(ids), skip_special_tokens=False)

    # ---------------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def _score(self, windows: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(continuation), greedy?) of (context ids, continuation ids) pairs, the input cut on the left
        to max_length tokens as lm-eval's `hf` does."""
        out = []
        for lo in range(0, len(windows), max(1, self.batch_size)):
            chunk = windows[lo:lo + max(1, self.batch_size)]
            rows = [(ctx + cont)[-(self.max_length + 1):][:-1] for ctx, cont in chunk]
            T = max(len(r) for r in rows)
            ids_BT = torch.full((len(rows), T), self.bos, dtype=torch.long)
            for i, r in enumerate(rows):
                ids_BT[i, :len(r)] = torch.tensor(r, dtype=torch.long)
            logp_BTV = F.log_softmax(self.model(ids_BT.to(self._device)).logits.float(), dim=-1)
            for i, ((_, cont), row) in enumerate(zip(chunk, rows)):
                n = len(cont)
                logp_NV = logp_BTV[i, len(row) - n:len(row)]
                target_N = torch.tensor(cont, dtype=torch.long, device=logp_NV.device)
                out.append((float(logp_NV.gather(1, target_N[:, None]).sum()),
                            bool((logp_NV.argmax(-1) == target_N).all())))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
        return self._score([(ctx, cont) for _, ctx, cont in requests])

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        totals = []
        for (string,) in [req.args for req in requests]:
            windows = [lm_utils.make_disjoint_window(w) for w in lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1)]
            totals.append(sum(ll for ll, _ in self._score(windows)))
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from nagmoe.eval.generate import generate_ids

        out = []
        for context, gen_kwargs in [req.args for req in requests]:
            until = gen_kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(gen_kwargs.get("max_gen_toks", 256))
            prompt = self.tok_encode(context)[-(self.max_length - max_new):] if max_new < self.max_length \
                else self.tok_encode(context)[-1:]
            new = generate_ids(self.model, prompt, min(max_new, self.max_length - len(prompt)), temperature=0.0,
                               stop_id=self.bos)
            text = self.tok_decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text.split(stop)[0]
            out.append(text)
        return out
