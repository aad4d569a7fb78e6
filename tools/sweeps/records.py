"""The sweeps' one way to report a measurement: a JSON line on stdout and the same line
appended to a results file. The file is opened for each line, so a sweep cut off by its
time limit still leaves every record it printed."""

from __future__ import annotations

import json
import os


def emit(record: dict, folder: str | None, filename: str) -> None:
    """Prints record as one JSON line; appends it to folder/filename when folder is set."""
    line = json.dumps(record)
    print(line, flush=True)
    if folder:
        with open(os.path.join(folder, filename), "a") as f:
            f.write(line + "\n")
