"""Run as a script by `nagmoe export-hf` (and the tests): load an export the way a user who never heard of nagmoe
does, in a process where `import nagmoe` fails and the hub is offline, and write what it computes.

    python hf_check.py EXPORT_DIR ROWS.pt RESULT.pt

ROWS.pt: {"ids": (B, T) int64}. RESULT.pt: {"logits": (B, T, V) fp32, "loading_info": {...}, "dtypes": {key:
dtype name}, "choices.<layer>": (B·T, k) experts, "mask.<sublayer>": (B, T) bool or absent}. Imports nothing
from nagmoe (it must not be importable here)."""
import sys


class _NoNagmoe:
    """A meta-path finder that makes `import nagmoe` fail, as on a machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name == "nagmoe" or name.startswith("nagmoe."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the export must not need nagmoe)")
        return None


def main(export_dir: str, rows_path: str, result_path: str) -> int:
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
    torch.save(out, result_path)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
