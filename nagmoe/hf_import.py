"""`nagmoe import-hf DIR --run-dir OUT`: a nagmoe export back into a run dir that `eval` and `generate` read.

Reads only DIR's `config.json` (bounded JSON, schema-checked: nagmoe's own config validation), `tokenizer.json`
and `model.safetensors` (no pickle) — never DIR's Python, which may come from anyone. Writes OUT/config.yaml
(the exported model section, data.seq_len, train.precision; data.data_dir = OUT/data), OUT/data/tokenizer.json
and a weights-only checkpoint OUT/checkpoints/step_<N> in the torch engine's layout (manifest verified on load
like any other). The model is loaded with `load_state_dict(strict=True)`: a missing, extra or reshaped tensor is
a one-line error. Continuing training from it is out of scope (no optimizer state, no data position)."""
from __future__ import annotations

import os

from nagmoe.errors import UserError, shown

MAX_CONFIG_BYTES = 1 << 20


def read_export_config(export_dir: str) -> dict:
    from nagmoe.read_files import expect, expect_object, read_json

    path = os.path.join(export_dir, "config.json")
    if not os.path.isfile(path):
        raise UserError(f"{shown(export_dir)}: no config.json (not a Hugging Face model directory)")
    if os.path.getsize(path) > MAX_CONFIG_BYTES:
        raise UserError(f"{shown(path)}: {os.path.getsize(path):,} bytes is too large for a model config")
    where = shown(path)
    data = expect_object(read_json(path), where)
    if data.get("model_type") != "nagmoe":
        raise UserError(f"{where}: model_type {shown(data.get('model_type'))} is not 'nagmoe' (only nagmoe exports "
                        "can be imported)")
    expect_object(expect(data, "nagmoe_model", dict, where), f"{where} nagmoe_model")
    expect(data, "seq_len", int, where)
    expect(data, "precision", str, where)
    return data


def import_export(export_dir: str, run_dir: str) -> str:
    """Import (module docstring); returns the checkpoint written."""
    from nagmoe.checkpoint.run_dir import CONFIG_FILE
    from nagmoe.checkpoint.torch_layout import save_checkpoint
    from nagmoe.config import config_from_dict
    from nagmoe.data.tokenizer import bos_id, check_vocab, read_tokenizer_bytes, tokenizer_from_bytes
    from nagmoe.hf_export import PREFIX
    from nagmoe.model import build_model
    from nagmoe.safe_files import write_atomic
    from nagmoe.schema import dump_yaml

    if not os.path.isdir(export_dir):
        raise UserError(f"import-hf: {shown(export_dir)} is not a directory")
    if os.path.lexists(run_dir) and (not os.path.isdir(run_dir) or os.listdir(run_dir)):
        raise UserError(f"--run-dir: {shown(run_dir)} exists and is not an empty directory (nothing is overwritten)")
    data = read_export_config(export_dir)
    data_dir = os.path.join(os.path.abspath(run_dir), "data")
    cfg = config_from_dict({"model": data["nagmoe_model"],
                            "data": {"seq_len": data["seq_len"], "data_dir": data_dir},
                            "train": {"precision": data["precision"]}})
    tok_src = os.path.join(export_dir, "tokenizer.json")
    tok_bytes = read_tokenizer_bytes(tok_src)  # read once: what is checked is what is copied
    tokenizer = tokenizer_from_bytes(tok_bytes, tok_src)
    check_vocab(tokenizer, cfg.model.vocab_size, tok_src)
    bos_id(tokenizer, tok_src)
    weights = os.path.join(export_dir, "model.safetensors")
    if not os.path.isfile(weights):
        raise UserError(f"{shown(export_dir)}: no model.safetensors (sharded exports are not supported)")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{shown(weights)}: not a readable safetensors file ({shown(str(e), 120)})") from None
    outside = [k for k in tensors if not k.startswith(PREFIX)]
    if outside:
        raise UserError(f"{shown(weights)}: tensor {shown(outside[0])} is outside the {PREFIX!r} prefix")
    model = build_model(cfg.model, seed=0)  # every tensor is overwritten below; the caller's RNG stays as it was
    state = {k[len(PREFIX):]: v for k, v in tensors.items()}
    expected = model.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise UserError(f"{shown(weights)}: does not match the config's model ({len(missing)} missing, e.g. "
                        f"{shown(missing[:2])}; {len(extra)} unexpected, e.g. {shown(extra[:2])})")
    for key, t in state.items():
        if t.shape != expected[key].shape:
            raise UserError(f"{shown(weights)}: {shown(key)} has shape {tuple(t.shape)}, the config's model "
                            f"{tuple(expected[key].shape)}")
    model.load_state_dict({k: v.to(expected[k].dtype) for k, v in state.items()}, strict=True)
    source = data.get("source") if isinstance(data.get("source"), dict) else {}
    step = source.get("step") if isinstance(source.get("step"), int) and 0 <= source.get("step") < 2 ** 62 else 0
    os.makedirs(data_dir, exist_ok=True)
    write_atomic(os.path.join(data_dir, "tokenizer.json"), tok_bytes)
    write_atomic(os.path.join(run_dir, CONFIG_FILE), dump_yaml(cfg), durable=True)
    return save_checkpoint(run_dir, step, model, extra_state={"step": step, "imported_from": os.path.abspath(
        export_dir)[:4096]}, keep=1)
