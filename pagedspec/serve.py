"""``python -m pagedspec.serve [MODEL]``: the same as ``pagedspec serve [MODEL]``."""

import sys

from pagedspec.engine.serve.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
