"""One package, ``pagedspec``: the repository's top-level folders install as its sub-packages.

``pagedspec/engine`` is a link to ``engine/`` (likewise ``kernels``, ``scheduler``, ``memory``):
the folders stay where the design card puts them, every import reads ``pagedspec.<room>``,
site-packages holds only ``pagedspec`` (a wheel copies the files the links point to), and every
tool that reads a package from one folder sees the whole of it: editable installs, and grimp
under ``lint-imports``, which a ``package_dir`` mapping would leave with an empty package.
"""

import re
from pathlib import Path

from setuptools import find_packages, setup

VERSION = re.search(r'__version__ = "(.+)"', Path("pagedspec/__init__.py").read_text())[1]

setup(
    name="pagedspec",
    version=VERSION,
    description="Paged-KV LLM serving with Triton kernels and lossless speculative decoding",
    python_requires=">=3.10",
    packages=find_packages(include=["pagedspec", "pagedspec.*"]),
    package_data={
        "pagedspec.kernels": ["csrc/*"],
        "pagedspec.engine.spec_decode": ["heads/*/*"],
        "pagedspec.engine.tools.train_eagle": ["*.txt"],
    },
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        "transformers>=4.46",
        "xformers; platform_system == 'Linux' and platform_machine == 'x86_64'",
        "numpy",
        "safetensors",
        "gguf",
        "tokenizers",
        "tqdm",
        "matplotlib",
        "fastapi",
        "uvicorn",
        "prometheus_client",
        "llguidance>=1.9",  # structured outputs (engine/sample/grammar.py)
    ],
    extras_require={
        "dev": [
            "pytest",
            "hypothesis",
            "ruff",
            "import-linter",
            "accelerate",
            "openai",
            "httpx",
            "jsonschema",
            "kernels",  # Hugging Face's: tests/test_packaging.py imports pagedspec beside it
        ],
    },
    entry_points={"console_scripts": ["pagedspec=pagedspec.cli:main"]},
)
