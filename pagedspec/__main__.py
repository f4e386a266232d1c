"""``python -m pagedspec``: the same as the ``pagedspec`` command."""

import sys

from pagedspec.checkout import root_last

root_last()  # (run from a checkout's root: see there)

from pagedspec.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
