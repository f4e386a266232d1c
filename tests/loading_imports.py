"""The modules a fresh interpreter has imported once it loaded a model and its tokenizer."""

import json
import subprocess
import sys

# transformers 5's model config classes import activations -> hub kernels ->
# torch.distributed.tensor -> sympy (engine/models/hf_config.py)
CONFIG_CHAIN = ("sympy", "transformers.activations", "transformers.models.llama.configuration")


def imported_after_loading(path: str, prefixes: tuple[str, ...]) -> list[str]:
    """The sorted names starting with one of ``prefixes`` in sys.modules after
    ``load_model(path)`` (with its tokenizer) in a new interpreter."""
    code = (
        "import json, sys; from pagedspec.engine.loader.model_loader import load_model; "
        f"assert load_model({path!r}).tokenizer is not None; "
        f"print(json.dumps(sorted(m for m in sys.modules if m.startswith({prefixes!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)
