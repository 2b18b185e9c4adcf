"""FSDP on CPU processes, for checks only: `ft-accum check` and the tests.

Accelerate 1.15 switches its FSDP plugin on only for GPU process groups (`AcceleratorState`:
`distributed_type in [MULTI_GPU, ...]`, MULTI_CPU not among them), so an FSDP config under
ACCELERATE_USE_CPU runs DDP, and the recipes refuse that launch (run_outputs.check_accelerator).
`switch_on()` turns the plugin on over gloo as Accelerate would on GPUs: the recipes then run
torch's real FSDP2 (`fully_shard`, sharded state dicts) on CPU processes. Training this way is
not a product path (no speed, no memory gain); checking that every rank makes every model call
is.
"""

from __future__ import annotations


def switch_on() -> None:
    """Patch Accelerate's state, in this process, so that an FSDP config runs FSDP on CPU."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    init = state.AcceleratorState.__init__
    if getattr(init, "fsdp_on_cpu", False):
        return

    def init_with_fsdp_on_cpu(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        # A later AcceleratorState() copies PartialState's MULTI_CPU back over it: set it each time.
        plugin = fsdp_plugin or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if fsdp_plugin is not None and self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin

    init_with_fsdp_on_cpu.fsdp_on_cpu = True
    state.AcceleratorState.__init__ = init_with_fsdp_on_cpu
