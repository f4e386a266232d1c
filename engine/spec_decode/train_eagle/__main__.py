import os

# Spinning OpenMP threads collapse when another process holds one of the cores (measured 7x
# slower on a shared 2-core machine); passive waiting keeps both threads useful. Must be set
# before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from engine.spec_decode.train_eagle.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
