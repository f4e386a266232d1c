"""``pip install .`` puts one package into site-packages, ``pagedspec``, with the files it reads at
run time, and it imports beside Hugging Face's ``kernels`` under the transformers that is
installed (setup.py pins none below a release)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A non-editable install of the checkout into an empty folder (no dependencies)."""
    target = tmp_path_factory.mktemp("site")
    build = tmp_path_factory.mktemp("build")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-q",
         "--target", str(target), str(ROOT)],
        check=True, capture_output=True, text=True, cwd=build, timeout=300,
    )  # fmt: skip
    return target


def test_only_pagedspec_lands_in_site_packages(installed):
    top = {p.name for p in installed.iterdir()}
    assert {n for n in top if not n.endswith(".dist-info") and n != "bin"} == {"pagedspec"}
    assert (installed / "bin" / "pagedspec").is_file()  # the one console command
    entry = next(installed.glob("pagedspec-*.dist-info")) / "entry_points.txt"
    assert entry.read_text().split() == ["[console_scripts]", "pagedspec", "=",
                                         "pagedspec.cli:main"]  # fmt: skip


def test_the_install_carries_what_the_code_reads(installed):
    package = installed / "pagedspec"
    assert not any(p.is_symlink() for p in package.iterdir())  # the links' files, copied
    assert (package / "kernels" / "csrc" / "bindings.cpp").is_file()
    head = package / "engine" / "spec_decode" / "heads" / "smollm2-135m-eagle"
    assert (head / "config.json").is_file() and (head / "model.safetensors").is_file()
    assert (package / "engine" / "tools" / "train_eagle" / "chat_prompts.txt").is_file()
    assert (package / "scheduler" / "scheduler.py").is_file()
    assert (package / "memory" / "block_manager.py").is_file()


def test_the_installed_package_imports_beside_hugging_faces_kernels(installed, tmp_path):
    """From another folder, with only the install on the path before the venv's packages:
    ``import kernels`` is Hugging Face's, ours is ``pagedspec.kernels``, and transformers'
    model code (which imports HF's ``kernels`` from 5.25 on) loads beside the engine."""
    code = (
        "import kernels, transformers, pagedspec\n"
        "from pagedspec import LLM, EngineConfig, SamplingParams\n"
        "from pagedspec.kernels import paged_attention\n"
        "from transformers import LlamaForCausalLM\n"
        "assert 'pagedspec' not in kernels.__file__, kernels.__file__\n"
        "assert pagedspec.__file__.startswith(sys.argv[1]), pagedspec.__file__\n"
        "print(transformers.__version__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", "import sys\n" + code, str(installed)],
        cwd=tmp_path, env={"PYTHONPATH": str(installed), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
