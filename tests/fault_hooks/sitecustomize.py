"""Test-only fault hooks, imported at start-up by every Python process whose PYTHONPATH holds this folder.

- FT_ACCUM_FREEZE_BEFORE_PUBLISHING=.tmp-step_000045: the process that is about to rename that
  half-published checkpoint folder into place writes FT_ACCUM_FROZEN_MARKER and stops itself
  (SIGSTOP) instead. The test then SIGKILLs it: a kill inside the checkpoint write, every time.
  Polling for the folder instead missed the write's few milliseconds on a loaded 2-core CI machine.
- FT_ACCUM_SLOW_PUBLISH_SECONDS=2: every checkpoint takes that much longer to write, as a real
  model's does (seconds, not a tiny model's milliseconds), so that a launcher that returns before
  the recipe has finished its checkpoint is seen to do so every time.
"""

import os
import signal
import time
from pathlib import Path

_FOLDER = os.environ.get("FT_ACCUM_FREEZE_BEFORE_PUBLISHING")
_SLOW = float(os.environ.get("FT_ACCUM_SLOW_PUBLISH_SECONDS", "0"))

if _FOLDER or _SLOW:
    _replace = os.replace

    def _hooked_replace(src, dst, *args, **kwargs):
        name = os.path.basename(os.fspath(src))
        if _FOLDER and name == _FOLDER:
            Path(os.environ["FT_ACCUM_FROZEN_MARKER"]).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
        if _SLOW and name.startswith(".tmp-step_"):
            time.sleep(_SLOW)
        return _replace(src, dst, *args, **kwargs)

    os.replace = _hooked_replace
