"""`nagmoe export-hf`: a run's model as a self-contained Hugging Face model (remote code in nagmoe/hf/).

    load   the run's checkpoint through nagmoe's one reader (any engine, any expert-parallel layout: the reader
           gathers it), optionally the compute dial (`skip_rate`) applied
    map    identity: nagmoe's persistent state dict under the prefix `model.` (experts stay stacked as trained);
           `load_state_dict(strict=True)` into NagMoeForCausalLM, so a missing, extra or reshaped key stops here
    cast   `bfloat16` casts by role (nagmoe/model/roles.py): matrices, the embedding and the unembedding (expert
           stacks included); gates, g_encode, temperatures, convolutions, the router, scalars and every buffer
           stay as they are, and `_keep_in_fp32_modules_strict` is built from the same list
    write  config.json (+ auto_map), model.safetensors, the model files, tokenizer (BOS first, as nagmoe trains),
           generation_config.json, README.md (model card) and provenance.json into a temporary sibling of `out`
    check  unless `validate=False`: in a subprocess where `import nagmoe` fails and the hub is offline, load it
           with AutoModelForCausalLM and compare on 2 validation rows (`compare`); then rename onto `out`.
           A failed check leaves nothing at `out`.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from typing import Optional

import torch

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import atomic_writer, make_temp_dir, write_atomic
from nagmoe.checkpoint.milestone import LOW_PRECISION_ROLES  # what a bf16 export casts, as a bf16 milestone

HF_FILES = ("configuration_nagmoe.py", "modeling_nagmoe.py", "layers_nagmoe.py", "nag_math.py")
HF_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote")
CHECK_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "check.py")
PREFIX = "model."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# the export's own check (fp32): nagmoe's logits within this in log-probability, choices and masks identical
MAX_LOGP_DIFF = 1e-4
BF16_MIN_TOP1, BF16_MAX_KL = 0.99, 1e-3


def require_transformers(what: str) -> None:
    try:
        import safetensors  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        raise UserError(f"{what}: needs the `hf` extra (pip install -e '.[hf]': transformers, safetensors)") from None


def layout_of(model) -> dict:
    """The sizes the HF modeling code builds with, read off the native model (nagmoe's rules computed them)."""
    attn, ffn = model.blocks[0].attn, model.blocks[0].ffn
    a = model.config.attention
    out = {"n_heads": attn.n_heads, "n_kv_heads": attn.n_kv_heads, "head_dim": attn.head_dim,
           "rot_dims": attn.rot_dims, "rope_base": float(attn.rope_base),
           "qk_norm": bool(getattr(attn, "qk_norm", False)),
           "use_convs": bool(getattr(attn, "use_convs", False)),
           "use_qk_mean": bool(getattr(attn, "use_qk_mean", False)),
           "use_value_shift": bool(getattr(attn, "use_value_shift", False)),
           "conv_kernel_1": a.conv_kernel_1, "conv_kernel_2": a.conv_kernel_2,
           "ffn_hidden": ffn.hidden, "expert_bias": getattr(ffn, "expert_bias", None) is not None}
    mod = model.mod_calibrator()
    if mod is not None:
        out["mod_bins"], out["mod_eligible"] = mod.bins, list(mod.eligible_list)
    # parameters only: buffers are built with their own dtype (fp32, float64, bool) and a load keeps it, while a
    # pattern in the strict list would force a float64 histogram or a bool flag to fp32
    out["fp32_keys"] = sorted(PREFIX + k for k in fp32_keys(model) if k in dict(model.named_parameters()))
    return out


def fp32_keys(model) -> set:
    """Native state-dict keys a bf16 export keeps in their own dtype: every buffer and every parameter whose
    role is not a matrix, the embedding or the unembedding."""
    from nagmoe.model.roles import param_roles

    roles = param_roles(model)
    keep = {k for k in model.state_dict() if k not in roles}  # persistent buffers
    return keep | {k for k, role in roles.items() if role not in LOW_PRECISION_ROLES}


def export_state(model, dtype: torch.dtype) -> dict:
    """nagmoe's persistent state under PREFIX, cast by role (module docstring)."""
    keep = fp32_keys(model)
    out = {}
    for key, t in model.state_dict().items():
        t = t.detach().cpu()
        if dtype != torch.float32 and key not in keep and t.is_floating_point():
            t = t.to(dtype)
        out[PREFIX + key] = t.contiguous()
    return out


def hf_config(run, layout: dict, source: dict):
    from nagmoe.hf.remote.configuration_nagmoe import NagMoeConfig
    from nagmoe.config.schema import to_dict

    cfg = run.config
    hf = NagMoeConfig(nagmoe_model=to_dict(cfg.model), layout=layout, seq_len=cfg.data.seq_len,
                      precision=cfg.train.precision, source=source, bos_token_id=run.bos_id,
                      eos_token_id=run.bos_id, pad_token_id=run.bos_id)
    hf.auto_map = {"AutoConfig": "configuration_nagmoe.NagMoeConfig",
                   "AutoModelForCausalLM": "modeling_nagmoe.NagMoeForCausalLM"}
    hf.architectures = ["NagMoeForCausalLM"]
    return hf


def hf_tokenizer(run):
    """nagmoe's tokenizer as a fast HF tokenizer: BOS prepended (as every training document starts), special-token
    text in the input is ordinary text (`split_special_tokens`, as nagmoe encodes), eos = pad = bos."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tok = run.tokenizer
    bos = tok.id_to_token(run.bos_id)
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, run.bos_id)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=bos, pad_token=bos,
                                   model_max_length=run.config.model.max_seq_len, split_special_tokens=True,
                                   clean_up_tokenization_spaces=False)


def model_card(run, hf_cfg, source: dict, dtype: str) -> str:
    from nagmoe.config.flops import param_counts

    m = run.config.model
    counts = param_counts(m)
    arch = (f"{'NAG' if m.residual == 'nag' else 'pre-norm'} residual stream, {m.attention.kind.upper()} attention, "
            f"{'MoE ' + str(m.moe.n_experts) + ' experts top-' + str(m.moe.top_k) if m.ffn == 'moe' else 'dense FFN'}"
            + (f", Mixture-of-Depths (skip rate {source.get('skip_rate')})" if m.mod.skip_rate > 0 else ""))
    bpb = source.get("val_bpb")
    return "\n".join([
        "---", "library_name: transformers", "tags: [nagmoe, custom_code]", "---", "",
        f"# nagmoe model from `{os.path.basename(os.path.abspath(source['run_dir']))}` (step {source['step']})", "",
        f"- architecture: {arch}; {m.n_layers} layers, width {m.d_model}, vocabulary {m.vocab_size}",
        f"- parameters: {counts.get('total', 'n/a'):,} total, {counts.get('active', 'n/a'):,} active per token"
        if isinstance(counts.get('total'), int) else "- parameters: see config.json",
        f"- trained on {source.get('tokens') or 'n/a'} tokens; validation bits per byte: "
        f"{'n/a' if bpb is None else f'{bpb:.4f}'}",
        f"- weights: {dtype}"
        + (f" (from a {source['milestone_dtype']} weights-only milestone)" if source.get("milestone_dtype") else "")
        + f"; training context {hf_cfg.seq_len}; nagmoe commit {source.get('commit', 'unknown')}", "",
        "## Load", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "model = AutoModelForCausalLM.from_pretrained(PATH, trust_remote_code=True)",
        "tok = AutoTokenizer.from_pretrained(PATH)  # prepends the BOS every training document starts with",
        "```", "",
        "The modeling code (modeling_nagmoe.py and siblings) is self-contained: torch and transformers only. It is "
        "an eager inference implementation; logits are fp32.", ""])


def _source(run, run_dir: str, checkpoint: str, skip_rate: Optional[float]) -> dict:
    from nagmoe.checkpoint.files import read_checkpoint_state, sha256_and_sync
    from nagmoe.rundir.info import git_commit, read_run_info, read_summary

    manifest = os.path.join(checkpoint, "manifest.json")
    summary = read_summary(run_dir) or {}
    info = read_run_info(run_dir) or {}
    state_step, extra = None, {}
    try:
        state = read_checkpoint_state(checkpoint)
        state_step, extra = state.get("step"), state["extra"]
    except UserError:
        pass
    # an earlier checkpoint or a milestone: its own tokens, and no bpb (summary.json's is the final model's)
    tokens = extra.get("progress", {}).get("tokens")
    final = tokens is None or tokens == summary.get("tokens")
    return {"run_dir": os.path.abspath(run_dir), "checkpoint": os.path.abspath(checkpoint),
            "checkpoint_manifest_sha256": sha256_and_sync(manifest) if os.path.isfile(manifest) else None,
            "step": state_step, "tokens": summary.get("tokens") if final else tokens,
            "val_bpb": summary.get("val_bpb") if final else None,
            "milestone_dtype": extra.get("dtype"),  # bf16 | fp32: a weights-only milestone (checkpoint/milestone.py)
            "run_commit": info.get("git_commit"), "commit": git_commit(),
            "skip_rate": skip_rate if skip_rate is not None else run.config.model.mod.skip_rate}


def validation_rows(run, rows: int = 2, seed: int = 0) -> torch.Tensor:
    """`rows` windows of the run's validation split (data.seq_len tokens each, capped at max_seq_len), or, when
    the split is gone, seeded random ids starting with BOS."""
    from nagmoe.data import shards
    from nagmoe.data.loader import TokenShards, iter_eval_batches

    cfg = run.config
    seq_len = min(cfg.data.seq_len, cfg.model.max_seq_len)
    if os.path.isfile(os.path.join(cfg.data.data_dir, shards.INDEX)):
        val = TokenShards(cfg.data.data_dir, "val", verify=cfg.data.verify_shards)
        for x_BT, _ in iter_eval_batches(val, seq_len, rows, max_tokens=rows * seq_len):
            if x_BT.shape[0] == rows:
                return x_BT.long()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.model.vocab_size, (rows, seq_len), generator=g)
    ids[:, 0] = run.bos_id
    return ids


@torch.no_grad()
def native_outputs(model, ids_BT: torch.Tensor) -> dict:
    """nagmoe's fp32 logits, expert choices (per MoE sublayer, on the tokens it routed) and MoD masks."""
    out, masks = {}, {}
    hooks = []
    for i, block in enumerate(model.blocks):
        ffn = block.ffn
        if hasattr(ffn, "router"):
            def grab(module, args, logits, key=f"choices.{2 * i + 1}", layer=ffn):
                out[key] = layer.select_experts(logits.softmax(-1))
            hooks.append(ffn.router.register_forward_hook(grab))
    mod = model.mod_calibrator()
    original = None
    if mod is not None:
        original = mod.select

        def select(index, score_BT):
            chosen = original(index, score_BT)
            if chosen is not None:
                masks[f"mask.{index}"] = chosen.mask_BT.clone()
            return chosen
        mod.select = select
    try:
        out["logits"] = model(ids_BT).logits.float()
    finally:
        for h in hooks:
            h.remove()
        if mod is not None:
            del mod.select  # the instance attribute: the class method again
    out.update(masks)
    return out


def compare(native: dict, hf: dict, dtype: str) -> list[str]:
    """What differs between nagmoe's outputs and the export's (empty: equal within the export's tolerance)."""
    problems = []
    lp_n = native["logits"].log_softmax(-1)
    lp_h = hf["logits"].float().log_softmax(-1)
    if lp_n.shape != lp_h.shape:
        return [f"logits shape {tuple(lp_h.shape)} != nagmoe's {tuple(lp_n.shape)}"]
    if dtype == "float32":
        diff = float((lp_n - lp_h).abs().max())
        if not diff <= MAX_LOGP_DIFF:
            problems.append(f"max |Δ log p| {diff:.3g} > {MAX_LOGP_DIFF:g}")
    else:
        top1 = float((lp_n.argmax(-1) == lp_h.argmax(-1)).float().mean())
        kl = float((lp_n.exp() * (lp_n - lp_h)).sum(-1).mean())
        if top1 < BF16_MIN_TOP1 or not kl <= BF16_MAX_KL:
            problems.append(f"bf16: top-1 agreement {top1:.2%} (>= {BF16_MIN_TOP1:.0%}), mean KL {kl:.3g} "
                            f"(<= {BF16_MAX_KL:g})")
        return problems
    masks = {k for k in set(native) | set(hf) if k.startswith("mask.")}
    for key in sorted(masks):
        if key not in native or key not in hf or not torch.equal(native[key], hf[key]):
            problems.append(f"MoD executed mask of sublayer {key.split('.')[1]} differs")
    for key in sorted(k for k in native if k.startswith("choices.")):
        got = hf.get(key)
        mask = hf.get("mask." + key.split(".")[1])
        if got is not None and mask is not None:
            got = got[mask.reshape(-1)]
        if got is None or not torch.equal(native[key], got):
            problems.append(f"expert choices of sublayer {key.split('.')[1]} differ")
    return problems


def run_check(export_dir: str, ids_BT: torch.Tensor, workdir: str) -> dict:
    """The check script (nagmoe/hf/check.py) in a fresh process: nagmoe blocked, hub offline, its own module
    cache; returns what it computed."""
    from nagmoe.hf.check import parse_result

    rows = os.path.join(workdir, "rows.pt")
    with atomic_writer(rows, binary=True) as f:
        torch.save({"ids": ids_BT}, f)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_MODULES_CACHE": os.path.join(workdir, "modules"), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run([sys.executable, CHECK_SCRIPT, export_dir, rows], env=env, cwd=workdir,
                          capture_output=True, text=True, timeout=900)
    result = parse_result(proc.stdout) if proc.returncode == 0 else None
    if result is None:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise ExportCheckFailed(f"the export does not load without nagmoe: {last[:300]}")
    return result


class ExportCheckFailed(Exception):
    """The export was written but does not reproduce the run (exit 1; nothing is left at --out)."""


def check_out_dir(out: str) -> None:
    if os.path.lexists(out) and not (os.path.isdir(out) and not os.path.islink(out) and not os.listdir(out)):
        raise UserError(f"--out: {shown(out)} exists and is not an empty directory (nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise UserError(f"--out: the parent directory {shown(parent)} does not exist")


def export_run(run_dir: str, out: str, checkpoint: Optional[str] = None, dtype: str = "float32",
               skip_rate: Optional[float] = None, validate: bool = True) -> dict:
    """Export (module docstring); returns {"out", "checked": what the check measured or None}."""
    require_transformers("export-hf")
    if dtype not in DTYPES:
        raise UserError(f"--dtype: {shown(dtype)} is not one of {', '.join(DTYPES)}")
    check_out_dir(out)
    from nagmoe.eval.generate import load_run, set_skip_rate
    from nagmoe.hf.remote.modeling_nagmoe import NagMoeForCausalLM

    run = load_run(run_dir, "cpu", checkpoint)
    if run.config.train.precision != "uniform":
        raise UserError(f"{shown(run_dir)}: train.precision={shown(run.config.train.precision)} (a run from before "
                        "the precision policy) cannot be exported: the HF model implements `uniform` numerics")
    if skip_rate is not None:
        set_skip_rate(run, skip_rate)
    model = run.model.eval()
    source = _source(run, run_dir, run.checkpoint, skip_rate)
    layout = layout_of(model)
    hf_cfg = hf_config(run, layout, source)
    hf_cfg.dtype = dtype
    hf_model = NagMoeForCausalLM(hf_cfg)
    state = export_state(model, DTYPES[dtype])
    hf_model.load_state_dict(state, strict=True)
    for key, t in hf_model.state_dict().items():  # load_state_dict copies into fp32 tensors: restore the cast
        if state[key].dtype != t.dtype:
            _set_tensor(hf_model, key, state[key])
    parent = os.path.dirname(os.path.abspath(out))
    # a fresh sibling, mode 0777 minus the umask (it becomes --out: a shared tree's group must read it)
    tmp = make_temp_dir(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-", mode=0o777)
    work = tempfile.mkdtemp(prefix="nagmoe-export-check-")  # private (0700): the check's rows and module cache
    try:
        hf_model.save_pretrained(tmp)
        for name in HF_FILES:
            with open(os.path.join(HF_DIR, name), "rb") as f:
                write_atomic(os.path.join(tmp, name), f.read())
        hf_tokenizer(run).save_pretrained(tmp)
        _generation_config(run).save_pretrained(tmp)
        write_atomic(os.path.join(tmp, "README.md"), model_card(run, hf_cfg, source, dtype))
        write_atomic(os.path.join(tmp, "provenance.json"), json.dumps(source, indent=1))
        publish_file_modes(tmp)
        checked = None
        if validate:
            ids = validation_rows(run)
            native = native_outputs(model, ids)
            hf = run_check(tmp, ids, work)
            info = hf["loading_info"]
            problems = [f"loading report: {k} {v[:5]}" for k, v in info.items() if v]
            problems += [f"dtype of {k}: {hf['dtypes'].get(k)} != {str(t.dtype)}" for k, t in state.items()
                         if hf["dtypes"].get(k) != str(t.dtype)][:5]
            problems += compare(native, hf, dtype)
            if problems:
                raise ExportCheckFailed("the export does not reproduce the run: " + "; ".join(problems)[:600])
            checked = {"rows": int(ids.shape[0]), "tokens": int(ids.numel())}
        if os.path.isdir(out):
            os.rmdir(out)  # empty (checked above)
        os.replace(tmp, out)
        tmp = None
        return {"out": out, "checked": checked}
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def publish_file_modes(directory: str) -> None:
    """One mode rule for the export's files: the directory's, without execute (0644 under umask 022; 0664 under
    002). transformers' safetensors writer leaves model.safetensors 0600, which would lock a shared tree's group
    out of the one file that matters. The directory is our fresh temporary: its entries are ours (fchmod through
    O_NOFOLLOW, never a link)."""
    mode = os.stat(directory).st_mode & 0o666
    for name in os.listdir(directory):
        try:
            fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # a link or something unreadable: not one of the files written above
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                os.fchmod(fd, mode)
        finally:
            os.close(fd)


def _set_tensor(model, key: str, value: torch.Tensor) -> None:
    module_name, _, name = key.rpartition(".")
    module = model.get_submodule(module_name)
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(value.clone(), requires_grad=False)
    else:
        module._buffers[name] = value.clone()


def _generation_config(run):
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=run.bos_id, eos_token_id=run.bos_id, pad_token_id=run.bos_id,
                            do_sample=False)
