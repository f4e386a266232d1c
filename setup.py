from setuptools import find_packages, setup

setup(
    name="pagedspec",
    version="0.1.0",
    description="Paged-KV LLM serving with Triton kernels and lossless speculative decoding",
    python_requires=">=3.10",
    packages=find_packages(include=["engine*", "kernels*", "scheduler*", "memory*"]),
    install_requires=[
        "torch>=2.4",
        "triton>=3.0",
        # 5.25 made Hugging Face's `kernels` package a hard dependency, and transformers imports
        # it by that name whenever it is installed: our top-level `kernels/` shadows it and every
        # model config import fails (ImportError: cannot import name 'CUDAProperties').
        "transformers>=4.46,<5.25",
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
        "llguidance>=1.9",  # structured outputs (engine/grammar.py)
    ],
    extras_require={
        "dev": ["pytest", "hypothesis", "ruff", "accelerate", "openai", "httpx", "jsonschema"],
    },
    entry_points={
        "console_scripts": [
            "pagedspec-generate=engine.generate:main",
            "pagedspec-serve=engine.serve.__main__:main",
        ]
    },
)
