"""The Hugging Face model files that `nagmoe export-hf` ships with every export (remote code): they import the
standard library, torch, transformers and each other only, never nagmoe (tests/hf/test_self_contained.py).
`nag_math.py` is a byte copy of nagmoe/ops/nag_math.py (a test keeps them equal). This `__init__` is not shipped."""
