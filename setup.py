from setuptools import find_packages, setup

setup(
    name="nagmoe",
    version="0.1.0",
    description="MoE language-model pretraining with a norm-agnostic (NAG) residual stream, CCA and MoD",
    packages=find_packages(include=["nagmoe", "nagmoe.*"]),
    # the package at the project root, said explicitly: setuptools' editable install then writes a plain .pth
    # (the checkout on sys.path, appended) instead of an import finder, and prints no warning wall (issue 61)
    package_dir={"": "."},
    python_requires=">=3.10",
    # torch range admits 2.11 (GPU machines) and 2.13 (CPU here); CPU installs pin torch==2.13.0 first
    # (see Makefile) so pip never pulls a CUDA build.
    install_requires=[
        "torch>=2.9,<2.15",
        "numpy",
        "pyyaml",
        "tqdm",
        "datasets>=3.0",
        "tokenizers>=0.20",
        "matplotlib",  # report figures
    ],
    extras_require={
        "dev": ["pytest>=8", "hypothesis"],  # + `python tools/install_corpus.py` (the offline corpus's files)
        "wandb": ["wandb"],
        "deepspeed": ["deepspeed==0.19.8"],
        # Hugging Face export, import and lm-evaluation-harness (nagmoe export-hf / import-hf / eval --lm-eval)
        "hf": ["transformers==5.23.0", "safetensors==0.8.0", "accelerate==1.16.0", "lm-eval==0.4.13"],  # install with DS_BUILD_OPS=0 on CPU machines
        # Optional CUDA fast paths: they build only on GPU machines; nothing imports them unless selected.
        "gpu": ["flash-attn", "megablocks"],
    },
    entry_points={"console_scripts": ["nagmoe=nagmoe.cli:main"]},
)
