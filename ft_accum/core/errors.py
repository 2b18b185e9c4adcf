"""The one error type the recipes turn into a one-line message instead of a traceback, and the one
place that turns it (and the other errors a user's input can cause) into that line."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

# Set by `ft-accum launch` when it starts several processes: a folder where each process's `error:` line
# goes instead of its stderr, for the launcher to print once (cli/launcher.py).
ERROR_DIR_ENV = "FT_ACCUM_ERROR_DIR"


class ConfigError(ValueError):
    """A setting or an input is wrong. The message names the problem and the fix."""


@contextlib.contextmanager
def one_line_errors():
    """Around a recipe's `main` or an `ft-accum` command: a ConfigError, an OSError on a user's path
    (unreadable, unwritable, full) or a Ctrl-C outside the loop's graceful stop ends as one `error:`
    line and a non-zero exit (130 for Ctrl-C), never a traceback."""
    try:
        yield
    except ConfigError as exc:
        _close_progress_bars()
        leave(f"error: {exc}")
    except OSError as exc:
        _close_progress_bars()
        where = f" ({exc.filename})" if exc.filename else ""
        leave(f"error: {exc.strerror or exc}{where}; check the path and its permissions or free space")
    except SystemExit as exc:  # the argument parser's own one line
        if isinstance(exc.code, str) and exc.code.startswith("error:"):
            leave(exc.code)
        raise
    except KeyboardInterrupt:
        _close_progress_bars()
        print(
            "error: stopped by Ctrl-C; resume with --resume_from_checkpoint latest if a checkpoint was saved",
            file=sys.stderr,
        )
        raise SystemExit(130) from None


def leave(message: str) -> None:
    """Exit 1 with `message` on stderr; under `ft-accum launch` with several processes (ERROR_DIR_ENV and
    torchrun's WORLD_SIZE > 1) the message goes to the launcher's folder instead, which prints each
    distinct message once, so that N processes refusing the same input make one line, not N."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        Path(folder, f"rank-{os.environ.get('RANK', '0')}").write_text(message)
        raise SystemExit(1) from None
    raise SystemExit(message) from None


_progress_bars: list = []


def register_progress_bar(bar) -> None:
    """Have `one_line_errors` close `bar` (anything with `close()`, e.g. a tqdm bar) before it prints an error."""
    _progress_bars.append(bar)


def _close_progress_bars() -> None:
    """End the open progress bars with their newline: a bar redraws with a carriage return and no newline, so
    an error printed after it would share its line (and `splitlines` would not find it at a line start)."""
    while _progress_bars:
        _progress_bars.pop().close()
