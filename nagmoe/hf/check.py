"""Run as a script by `nagmoe export-hf` (and the tests): load an export the way a user who never heard of nagmoe
does, in a process where `import nagmoe` fails and the hub is offline, and write what it computes.

    python check.py EXPORT_DIR ROWS.pt

ROWS.pt: {"ids": (B, T) int64}. The result goes to stdout as one line, RESULT_MARK + base64 of a torch.save of
{"logits": (B, T, V) fp32, "loading_info": {...}, "dtypes": {key: dtype name}, "choices.<layer>": (B·T, k)
experts, "mask.<sublayer>": (B, T) bool or absent} (no file: the process writes nothing). Imports nothing from
nagmoe (it must not be importable here)."""
import base64
import io
import sys

RESULT_MARK = "NAGMOE-HF-CHECK-RESULT "


class _NoNagmoe:
    """A meta-path finder that makes `import nagmoe` fail, as on a machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name == "nagmoe" or name.startswith("nagmoe."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the export must not need nagmoe)")
        return None


def main(export_dir: str, rows_path: str) -> int:
    sys.meta_path.insert(0, _NoNagmoe())
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(export_dir, trust_remote_code=True, dtype="auto",
                                                       output_loading_info=True)
    AutoTokenizer.from_pretrained(export_dir, trust_remote_code=True)  # loads (the tests check its ids)
    model.eval()
    ids_BT = torch.load(rows_path, weights_only=True)["ids"]
    with torch.no_grad():
        logits = model(ids_BT, use_cache=False).logits.float()
    out = {"logits": logits,
           "loading_info": {k: sorted(str(x) for x in v) for k, v in info.items() if k != "error_msgs"},
           "error_msgs": [str(x)[:300] for x in info.get("error_msgs", [])],
           "dtypes": {k: str(v.dtype) for k, v in model.state_dict().items()}}
    for i, block in enumerate(model.model.blocks):
        choices = getattr(block.ffn, "last_choices", None)
        if choices is not None:
            out[f"choices.{2 * i + 1}"] = choices
    mod = getattr(model.model.stream, "mod", None)
    if mod is not None:
        for index, mask in mod.last_masks.items():
            if mask is not None:
                out[f"mask.{index}"] = mask
    with io.BytesIO() as buffer:  # in memory: this process writes no file
        torch.save(out, buffer)
        data = buffer.getvalue()
    sys.stdout.write("\n" + RESULT_MARK + base64.b64encode(data).decode("ascii") + "\n")
    sys.stdout.flush()
    return 0


def parse_result(stdout: str):
    """The result a run of this script printed (None when it printed none)."""
    import torch

    lines = [line for line in stdout.splitlines() if line.startswith(RESULT_MARK)]
    if not lines:
        return None
    return torch.load(io.BytesIO(base64.b64decode(lines[-1][len(RESULT_MARK):])), weights_only=True)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
