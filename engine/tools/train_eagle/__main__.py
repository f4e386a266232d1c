"""``python -m pagedspec.engine.tools.train_eagle``: the same as ``pagedspec train-eagle``."""

from pagedspec.engine.tools.train_eagle.cli import main

if __name__ == "__main__":
    main()
