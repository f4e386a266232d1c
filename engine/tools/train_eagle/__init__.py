"""Offline training of an EAGLE-1 draft head: ``pagedspec train-eagle``."""

import os

# Spinning OpenMP threads collapse when another process holds one of the cores (measured 7x
# slower on a shared 2-core machine); passive waiting keeps both threads useful. Must be set
# before torch starts its thread pool, so here, before any module of the trainer loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
