"""`nagmoe import-hf DIR --run-dir OUT`: a nagmoe export back into a run dir that `eval` and `generate` read.

Reads only DIR's `config.json` (bounded JSON, schema-checked: nagmoe's own config validation), `tokenizer.json`
and `model.safetensors` (no pickle) — never DIR's Python, which may come from anyone. Writes OUT/config.yaml
(the exported model section, data.seq_len, train.precision; data.data_dir = OUT/data), OUT/data/tokenizer.json
and a weights-only checkpoint OUT/checkpoints/step_<N> in the torch engine's layout (manifest verified on load
like any other). The weights' header is checked against the config's model before any data is read (nagmoe/
safetensors_header.py; the model on the meta device): a missing, extra, reshaped or wrongly typed tensor (an
integer where a weight belongs) is a one-line error, and so is a model too large for the machine. Continuing
training from it is out of scope (no optimizer state, no data position)."""
from __future__ import annotations

import os

import torch

from nagmoe.base.errors import UserError, shown

MAX_CONFIG_BYTES = 1 << 20
_DTYPE_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
                torch.bool: "BOOL", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                torch.uint8: "U8"}
_FLOAT_WEIGHTS = {"F32", "BF16", "F16"}  # what an export holds a floating tensor as (`--dtype`, by role)


def read_export_config(export_dir: str) -> dict:
    from nagmoe.base.files import expect, expect_object, read_json

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
    """Import (module docstring); returns the checkpoint written. Everything is checked before anything is
    allocated or written: the config, the tokenizer (bounded), then the weights' header against the model the
    config describes (built on the meta device: shapes and dtypes, no memory); a model the machine cannot hold
    is refused by its size, and a MemoryError that still happens anywhere is one line. A failure leaves OUT as
    it was (absent, or empty)."""
    if not os.path.isdir(export_dir):
        raise UserError(f"import-hf: {shown(export_dir)} is not a directory")
    if os.path.lexists(run_dir) and (not os.path.isdir(run_dir) or os.listdir(run_dir)):
        raise UserError(f"--run-dir: {shown(run_dir)} exists and is not an empty directory (nothing is overwritten)")
    existed = os.path.isdir(run_dir)  # and empty: everything in it after a failure is ours to remove
    try:
        return _import(export_dir, run_dir)
    except MemoryError:
        _clear(run_dir, existed)
        raise UserError(f"import-hf: {shown(export_dir)}: out of memory while importing it (config.json's model "
                        "or a file is larger than this process can hold)") from None
    except BaseException:
        _clear(run_dir, existed)
        raise


def _import(export_dir: str, run_dir: str) -> str:
    from nagmoe.config import config_from_dict
    from nagmoe.data.tokenizer import bos_id, check_vocab, read_tokenizer_bytes, tokenizer_from_bytes

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
    expected = check_weights_header(weights, cfg.model)
    check_memory(expected, weights)
    source = data.get("source") if isinstance(data.get("source"), dict) else {}
    step = source.get("step") if isinstance(source.get("step"), int) and 0 <= source.get("step") < 2 ** 62 else 0
    model = load_weights(weights, cfg.model)
    return _write_run(run_dir, cfg, tok_bytes, model, step, export_dir)


def expected_tensors(model_cfg) -> dict:
    """{key: meta tensor} of the state dict of the model `model_cfg` describes: shapes and dtypes, no storage."""
    from nagmoe.model import build_model

    return build_model(model_cfg, device="meta").state_dict()


def check_weights_header(weights: str, model_cfg) -> dict:
    """The header of `weights` against the config's model, before a byte of data is mapped: the total size
    first, then names, shapes and dtypes. Every refusal names the tensors at fault (`_mismatch`: missing,
    unexpected, mis-shaped), also when the sizes already disagree, unless the config's depth makes laying the model
    out on the meta device costly (NAMED_DEPTH). Returns the expected {key: meta tensor}."""
    from nagmoe.config.flops import param_counts
    from nagmoe.hf.export import PREFIX
    from nagmoe.hf.safetensors_header import read_header, total_elements

    where = shown(weights)
    entries = read_header(weights)
    outside = [k for k in entries if not k.startswith(PREFIX)]
    if outside:
        raise UserError(f"{where}: tensor {shown(outside[0])} is outside the {PREFIX!r} prefix")
    params, held = param_counts(model_cfg)["total"], total_elements(entries)
    state = {k[len(PREFIX):]: e for k, e in entries.items()}
    if params > held:  # the header's values include buffers: parameters alone must fit in them
        # name the tensors when the config's model is cheap to lay out on the meta device (a hostile depth is not)
        described = _mismatch(expected_tensors(model_cfg), state) if model_cfg.n_layers <= NAMED_DEPTH else None
        raise UserError(f"{where}: holds {held:,} values, the config's model has {params:,} parameters (config.json "
                        f"and the weights do not belong together{': ' + described if described else ''})")
    expected = expected_tensors(model_cfg)
    described = _mismatch(expected, state)
    if described:
        raise UserError(f"{where}: does not match the config's model ({described})")
    for key, e in state.items():
        want = expected[key]
        allowed = {_DTYPE_NAMES[want.dtype]} | (_FLOAT_WEIGHTS if want.dtype.is_floating_point else set())
        if e.dtype not in allowed:
            raise UserError(f"{where}: {shown(PREFIX + key)} has dtype {e.dtype}; the model holds it as "
                            f"{', '.join(sorted(allowed))}")
    return expected


NAMED_DEPTH = 256  # up to this depth a mismatch is named even when the sizes already disagree (a meta build < 1 s)
NAMED = 3  # tensors named per kind of mismatch, then a count


def _names(keys: list, detail=lambda key: "") -> str:
    from nagmoe.hf.export import PREFIX

    named = ", ".join(shown(PREFIX + key, 100) + detail(key) for key in keys[:NAMED])
    return named + (f" and {len(keys) - NAMED} more" if len(keys) > NAMED else "")


def _mismatch(expected: dict, state: dict):
    """What separates the header's tensors from the model's, bounded (the first few by name, then a count):
    "1 missing: 'model.wte.weight'; 2 unexpected: ...; 1 mis-shaped: 'model.x' has shape (3, 4), the config's
    model (4, 4)",
    or None when names and shapes agree."""
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    reshaped = sorted(k for k in set(state) & set(expected) if tuple(state[k].shape) != tuple(expected[k].shape))
    parts = [f"{len(missing)} missing: {_names(missing)}" if missing else "",
             f"{len(extra)} unexpected: {_names(extra)}" if extra else "",
             f"{len(reshaped)} mis-shaped: " + _names(reshaped, lambda k: f" has shape {shown(state[k].shape, 60)}, "
                                                  f"the config's model {tuple(expected[k].shape)}") if reshaped else ""]
    return "; ".join(p for p in parts if p) or None


def model_bytes(expected: dict) -> int:
    return sum(t.numel() * t.element_size() for t in expected.values())


def _gib(n: int) -> str:
    return f"{n / 2 ** 30:.3g}"


def check_memory(expected: dict, weights: str) -> None:
    """Refuse a model this process cannot hold (the weights plus one tensor being read), instead of the OOM
    killer or a MemoryError deep inside torch: the bound is /proc/meminfo's MemAvailable and the address-space
    limit left (RLIMIT_AS), whichever is smaller; unknown bounds are no bound."""
    need = model_bytes(expected) + max((t.numel() * 4 for t in expected.values()), default=0)
    have = available_memory()
    if have is not None and need > have:
        raise UserError(f"{shown(weights)}: the model needs about {_gib(need)} GiB of memory, this process has "
                        f"{_gib(have)} GiB available")


def available_memory():
    import resource

    bounds = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    bounds.append(int(line.split()[1]) * 1024)
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status") as f:
                vm = next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:")), 0)
            bounds.append(max(soft - vm, 0))
    except (OSError, ValueError):
        pass
    return min(bounds) if bounds else None


def load_weights(weights: str, model_cfg):
    """The model with every tensor read from `weights` (header already checked: the same keys, shapes and
    allowed dtypes), one tensor at a time (the peak is the model plus one tensor, not two models)."""
    from safetensors import SafetensorError, safe_open

    from nagmoe.hf.export import PREFIX
    from nagmoe.model import build_model

    model = build_model(model_cfg, seed=0)  # every tensor is overwritten below; the caller's RNG stays as it was
    state = model.state_dict()
    try:
        with safe_open(weights, framework="pt") as f, torch.no_grad():
            for key in f.keys():
                target = state.get(key[len(PREFIX):])
                if target is None:  # the header was checked: the file changed since
                    raise UserError(f"{shown(weights)}: changed while it was being imported ({shown(key)})")
                target.copy_(f.get_tensor(key))
    except (SafetensorError, OSError, ValueError) as e:
        raise UserError(f"{shown(weights)}: not a readable safetensors file ({shown(str(e), 120)})") from None
    except RuntimeError as e:
        if "alloc" in str(e):  # torch's DefaultCPUAllocator under an address-space limit
            raise MemoryError from None
        raise
    return model


def _write_run(run_dir: str, cfg, tok_bytes: bytes, model, step: int, export_dir: str) -> str:
    from nagmoe.rundir.info import CONFIG_FILE
    from nagmoe.checkpoint.torch_layout import save_checkpoint
    from nagmoe.base.files import write_atomic
    from nagmoe.config.schema import dump_yaml

    data_dir = cfg.data.data_dir
    os.makedirs(data_dir, exist_ok=True)
    write_atomic(os.path.join(data_dir, "tokenizer.json"), tok_bytes)
    write_atomic(os.path.join(run_dir, CONFIG_FILE), dump_yaml(cfg), durable=True)
    return save_checkpoint(run_dir, step, model, extra_state={"step": step, "imported_from": os.path.abspath(
        export_dir)[:4096]}, keep=1)


def _clear(run_dir: str, existed: bool) -> None:
    """Undo a failed import: OUT was absent or empty (checked first), so what is in it now is ours."""
    import shutil

    if not existed:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif os.path.isdir(run_dir):
        for name in os.listdir(run_dir):
            path = os.path.join(run_dir, name)
            shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) and not os.path.islink(path) \
                else os.unlink(path)
