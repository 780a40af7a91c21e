"""What the native module asks of Python: the progress bar and the wheel's own data files."""

import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

WIKITEXT2_FILE = "wikitext-2-raw-test.txt.gz"


def _seen() -> bool:
    """Whether a progress bar would be seen: stderr is a terminal, or this is Jupyter."""
    try:
        if sys.stderr is not None and sys.stderr.isatty():
            return True
    except (AttributeError, ValueError):
        pass
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None  # type: ignore[attr-defined]
    return type(shell).__name__ == "ZMQInteractiveShell"


def progress_bar(total: int, done: int) -> Optional[Any]:
    """A tqdm bar over ``total`` windows starting at ``done``, or None where nobody sees it."""
    if not _seen():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=done, unit="window", desc="windows", dynamic_ncols=True)


def wikitext_path() -> Optional[str]:
    """The WikiText-2 file the wheel installs (``share/exactscore/``), if installed."""
    try:
        files = metadata.files("exactscore") or []
    except metadata.PackageNotFoundError:
        return None
    for f in files:
        if f.name == WIKITEXT2_FILE:
            return str(Path(str(f.locate())).resolve())
    return None
