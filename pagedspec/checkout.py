"""Running from a checkout of the repository rather than an install.

Python puts the directory it runs from first on sys.path (``python -m pagedspec ...``,
``python -m benchmarks...``, pytest); at a checkout's root the folder ``kernels/`` (the source of
``pagedspec.kernels``) would then stand in for Hugging Face's ``kernels``, which transformers
imports by that name. ``root_last`` moves the root behind site-packages: installed packages come
first, and what only the checkout has (``benchmarks``, ``pagedspec`` itself) is still found.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def root_last() -> None:
    """In a checkout (``pagedspec/engine`` is a link to ``engine/``; an install copies it), put
    its root after every other entry of sys.path; elsewhere do nothing."""
    if not os.path.islink(os.path.join(ROOT, "pagedspec", "engine")):
        return
    at_root = [p for p in sys.path if os.path.abspath(p or os.curdir) == ROOT]
    sys.path[:] = [p for p in sys.path if p not in at_root] + at_root
