"""``python -m pagedspec``: the same as the ``pagedspec`` command."""

import sys

from pagedspec.cli import main

if __name__ == "__main__":
    sys.exit(main())
