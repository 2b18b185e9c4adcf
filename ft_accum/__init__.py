"""ft-accum: exact gradient accumulation for fine-tuning Hugging Face models on one small GPU.

One concept per module:
    arguments            the arguments every recipe shares (TrainingArguments), parsing with YAML
    batch_arithmetic     effective = micro × accumulation × processes (BatchPlan), and the update count
    lr_scaling           LR policies tied to the effective batch
    lr_schedule          scheduler length in optimizer updates
    loss_normalization   the exact window-mean gradient, incomplete last window included (AccumulationWindow)
    training_state       the loop's counters (TrainingState), resume position, the per-update record
    accumulation_schedule  a mid-run change of the effective batch (AccumulationScheduler)
    noise_scale          the gradient noise scale from accumulation's two batch sizes (NoiseScaleMeter)
    graceful_stop        SIGTERM/SIGINT: finish the update, checkpoint, print the resume command
    checkpointing        atomic checkpoints and resume
    banner               the start-of-run summary
    metrics              local `evaluate` modules (no hub)
    offline_assets       the bundled MiniLM weights and BBC News data
    memory_planner       peak memory of a training step, traced on fake tensors; `ft-accum plan`
    memory               measured peak memory, out-of-memory detection, shrinking the micro-batch
    data_sources         local files and hub datasets, with errors that name the fix
    run_outputs          the output-dir guard, metrics.jsonl, atomic final/ save, all_results.json
    run_setup            the Accelerator, the optimizer and the banner of a recipe
    testing              tiny models, generated data and recipe runners for tests and benchmarks
    benchmarking         per-update timings, the plain loop and the Trainer callback of the benchmarks
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
