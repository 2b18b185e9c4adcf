"""Test-only hooks, imported at start-up by every Python process whose PYTHONPATH holds this folder
(tests/conftest.py puts it there for every process a test launches).

- FT_ACCUM_TEST_WITHOUT_LOWMEM=1 (conftest.py sets it; `launch_command(lowmem=True)` clears it):
  the process runs as an install without the [lowmem] extra. bitsandbytes and torchao are hidden:
  `importlib.util.find_spec` returns None for a name that sys.modules maps to None, and importing it
  raises ImportError. transformers (its quantizer registry) and peft import both at start-up when
  they are installed, in every launch, LoRA or not (0.8 CPU-s per process, measured in
  docs/tests.md); and a recipe that needed them without being asked to would fail here.
- FT_ACCUM_FREEZE_BEFORE_PUBLISHING=.tmp-step_000045: the process that is about to rename that
  half-published checkpoint folder into place writes FT_ACCUM_FROZEN_MARKER and stops itself
  (SIGSTOP) instead. The test then SIGKILLs it: a kill inside the checkpoint write, every time.
  Polling for the folder instead missed the write's few milliseconds on a loaded 2-core CI machine.
- FT_ACCUM_SLOW_PUBLISH_SECONDS=2: every checkpoint takes that much longer to write, as a real
  model's does (seconds, not a tiny model's milliseconds), so that a launcher that returns before
  the recipe has finished its checkpoint is seen to do so every time.
- FT_ACCUM_TEST_NUM_LAYERS=1: every transformers model the process builds keeps only its first
  layer of each stack (`ft-accum check --num_layers`' `first_layers_only`): a recipe's shipped
  default model, loaded from its real checkpoint, made tiny (tests/test_engines.py).
- FT_ACCUM_TEST_SMOLLM2_DIR=/tmp/tiny-chat-lm: the recipes' default SmolLM2-135M-Instruct is that
  model instead (a tiny Llama with SmolLM2's real tokenizer and chat template: ft_accum.testing.
  make_tiny_chat_lm). The 135M model, even cut to one layer, keeps its 28M-parameter embedding,
  which a sample's every token all-gathers under FSDP (tests/test_engines.py).
- FT_ACCUM_TEST_SKIP_COLLECTIVE=eval:2: process 1 skips the first collective operation it is asked
  for in that phase after that many updates (ft_accum.training.collective_timeout.POSITION), as a
  recipe that makes a model call on one process only does, and stays away from collectives for
  the process group's timeout and 5 s more (a gloo process that goes on at once into a mismatched
  collective is aborted by gloo itself, which is not what this tests): the others wait in it.
- FT_ACCUM_TEST_OOM_ABOVE_ROWS=4: in the text-classification recipe's process (not its launcher),
  a BERT classifier's training forward of more than 4 rows raises CUDA's out-of-memory error, as a
  GPU too small for it would (tests/test_sweep.py).
"""

import os
import signal
import sys
import time
from pathlib import Path

if os.environ.get("FT_ACCUM_TEST_WITHOUT_LOWMEM") == "1":
    for _name in ("bitsandbytes", "torchao"):
        sys.modules.setdefault(_name, None)

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

# FT_ACCUM_FREEZE_IN_GGUF_WRITE=/tmp/marker: `ft-accum export` stops itself (SIGSTOP) once the GGUF's
# first two tensors are on disk, having written the marker; the test SIGKILLs it there, mid-file.
if os.environ.get("FT_ACCUM_FREEZE_IN_GGUF_WRITE"):
    import gguf as _gguf

    _write_padding = _gguf.GGUFWriter.write_padding
    _paddings = []

    def _freezing_write_padding(self, fp, n, *args, **kwargs):
        _write_padding(self, fp, n, *args, **kwargs)
        _paddings.append(n)
        if len(_paddings) == 3:  # the first pads the tensor table; each later one follows a tensor's data
            fp.flush()
            Path(os.environ["FT_ACCUM_FREEZE_IN_GGUF_WRITE"]).write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)

    _gguf.GGUFWriter.write_padding = _freezing_write_padding

# FT_ACCUM_TEST_FSDP_ON_CPU=1: Accelerate's FSDP plugin switched on for CPU process groups
# (ft_accum/training/fsdp_on_cpu.py, which `ft-accum check` uses too): the recipes then run torch's
# real FSDP2 on 2 CPU processes over gloo. The product refuses that combination
# (run_outputs.check_accelerator); this hook lets the tests check the recipes under the engine.
if os.environ.get("FT_ACCUM_TEST_FSDP_ON_CPU") == "1":
    from ft_accum.training.fsdp_on_cpu import switch_on as _switch_fsdp_on

    _switch_fsdp_on()

if os.environ.get("FT_ACCUM_TEST_NUM_LAYERS"):
    from ft_accum.cli.check import first_layers_only as _first_layers_only

    # Held for the whole process: a context manager nobody holds is collected at once, and its
    # generator's `finally` would put the whole models back (it did, unseen, until 2026-12-06).
    _LAYERS_CUT = _first_layers_only(int(os.environ["FT_ACCUM_TEST_NUM_LAYERS"]))
    _LAYERS_CUT.__enter__()

if os.environ.get("FT_ACCUM_TEST_SMOLLM2_DIR"):
    import ft_accum.data.offline_assets as _assets

    _assets.bundled_smollm2_dir = lambda cache_dir=None: Path(os.environ["FT_ACCUM_TEST_SMOLLM2_DIR"])

if os.environ.get("FT_ACCUM_TEST_SKIP_COLLECTIVE") and os.environ.get("RANK") == "1":
    import torch.distributed as _dist

    _phase, _after = os.environ["FT_ACCUM_TEST_SKIP_COLLECTIVE"].split(":")
    _skipped = []

    def _skipping(collective):
        def maybe_skip(*args, **kwargs):
            from ft_accum.training.collective_timeout import POSITION

            if not _skipped and POSITION.phase == _phase and POSITION.updates_done == int(_after):
                _skipped.append(collective.__name__)
                print(
                    f"test hook: process 1 skips {collective.__name__} ({_phase}:{_after})",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(POSITION.timeout_seconds + 5)
                return None
            return collective(*args, **kwargs)

        return maybe_skip

    for _name in (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "broadcast",
        "barrier",
        "reduce_scatter_tensor",
    ):
        setattr(_dist, _name, _skipping(getattr(_dist, _name)))

# FT_ACCUM_SLOW_UPDATE_SECONDS=0.2: every SGD or AdamW step sleeps that long first, so a short run lasts
# long enough for a signal to land mid-run; the updates themselves are unchanged.
if float(os.environ.get("FT_ACCUM_SLOW_UPDATE_SECONDS", "0")):
    import torch as _torch

    def _slowed(step):
        def _slow_step(self, *args, **kwargs):
            time.sleep(float(os.environ["FT_ACCUM_SLOW_UPDATE_SECONDS"]))
            return step(self, *args, **kwargs)

        return _slow_step

    for _optimizer in (_torch.optim.SGD, _torch.optim.AdamW):
        _optimizer.step = _slowed(_optimizer.step)

if os.environ.get("FT_ACCUM_TEST_OOM_ABOVE_ROWS") and sys.argv[0].endswith("text_classification.py"):
    import torch as _torch
    from transformers import BertForSequenceClassification as _Bert

    _forward, _rows = _Bert.forward, int(os.environ["FT_ACCUM_TEST_OOM_ABOVE_ROWS"])

    def _forward_within_memory(self, input_ids=None, **kwargs):
        if self.training and input_ids.shape[0] > _rows:
            raise _torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _forward(self, input_ids=input_ids, **kwargs)

    _Bert.forward = _forward_within_memory
