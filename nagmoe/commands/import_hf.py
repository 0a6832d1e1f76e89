"""`nagmoe import-hf DIR --run-dir OUT`: a nagmoe Hugging Face export back into a run dir for `eval` and
`generate` (nagmoe/hf/importer.py). Only config.json, tokenizer.json and model.safetensors are read; DIR's Python
never runs."""
from __future__ import annotations


def add_arguments(p):
    p.add_argument("export_dir", metavar="DIR", help="a directory written by `nagmoe export-hf`")
    p.add_argument("--run-dir", required=True, metavar="OUT", help="a new (or empty) run dir")


def run(args) -> int:
    from nagmoe.hf.export import require_transformers
    from nagmoe.hf.importer import import_export

    require_transformers("import-hf")
    checkpoint = import_export(args.export_dir, args.run_dir)
    print(f"[nagmoe] imported {args.export_dir} into {args.run_dir} ({checkpoint}); `nagmoe eval` and "
          "`nagmoe generate` read it")
    return 0
