"""Benchmarks: each module is a script (``python -m benchmarks.<name>``) that prints a table and
writes JSON (and a plot) under benchmarks/results; ``run_all`` runs them for ``make bench``.
They run from the checkout's root, which goes behind site-packages first
(``pagedspec.checkout`` says why)."""

from pagedspec.checkout import root_last

root_last()
