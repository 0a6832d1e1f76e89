"""Hugging Face interop (issue 54): a trained run leaves as a Hugging Face model and comes back.

  export.py              `nagmoe export-hf`: the run's model as safetensors + the remote code, checked in a
                         process where nagmoe cannot be imported
  importer.py            `nagmoe import-hf`: an export back into a run dir, every tensor checked before loading
  check.py               the export's check script (transformers only, no nagmoe)
  safetensors_header.py  the importer's bounded reader of a safetensors header
  remote/                the files shipped with every export (auto_map names them; the names never change)
"""
