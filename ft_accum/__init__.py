"""ft-accum: exact gradient accumulation for fine-tuning Hugging Face models on one small GPU.

Layers, each a package; imports point down only (docs/architecture.md, tests/test_architecture.py):
    core/      the accumulation math: batch_arithmetic, loss_normalization, lr_scaling, lr_schedule,
               accumulation_schedule, noise_scale; errors, integrity. No Accelerate, no torch.distributed.
    data/      data_sources, chat_data, offline_assets, metrics (local evaluate modules)
    models/    loading, lora, low_memory, norm, output_loss
    training/  what touches Accelerate: arguments, run_setup, run_outputs, training_state,
               checkpointing, graceful_stop, memory (OOM retry), banner
    planner/   memory_planner (`ft-accum plan`) and its model configs
    cli/       main (`ft-accum`), launcher, sweep, report, check
    testing/   tiny models, generated data and runners for the tests and benchmarks; benchmarking
"""

import logging

__version__ = "0.1.0"

# Notices that transformers' quantizer imports trigger whenever the [lowmem] extra is installed, on every
# run, none about what ft-accum uses: torchao's CUDA-only extensions not loading on a CPU machine, torch
# deprecating torchao's Enum registrations, and bitsandbytes' optional `kernels` package (fetched from
# the hub, so deliberately not installed) being absent. Other messages from these loggers still show.
_OPTIONAL_KERNEL_NOTICES = {
    "torchao": "Failed to load ",
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}
for _name, _start in _OPTIONAL_KERNEL_NOTICES.items():
    logging.getLogger(_name).addFilter(lambda record, start=_start: not str(record.msg).startswith(start))
