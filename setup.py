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
    ],
    extras_require={
        "dev": ["pytest", "hypothesis", "ruff", "accelerate", "openai", "httpx"],
    },
    entry_points={
        "console_scripts": [
            "pagedspec-generate=engine.generate:main",
            "pagedspec-serve=engine.serve.__main__:main",
        ]
    },
)
