"""``python -m pagedspec.serve [MODEL]``: the same as ``pagedspec serve [MODEL]``."""

import sys

from pagedspec.checkout import root_last

root_last()  # (run from a checkout's root: see pagedspec.checkout)

from pagedspec.engine.serve.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
