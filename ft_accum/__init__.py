"""ft-accum: exact gradient accumulation for fine-tuning Hugging Face models on one small GPU.

One concept per module:
    batch_arithmetic     effective = micro × accumulation × processes, and the update count
    lr_scaling           LR policies tied to the effective batch
    lr_schedule          scheduler length in optimizer updates
    loss_normalization   the exact window-mean gradient, incomplete last window included
    checkpointing        atomic checkpoints and resume
    banner               the start-of-run summary
    metrics              local `evaluate` modules (no hub)
    offline_assets       the bundled MiniLM weights and BBC News data
    memory_planner       peak memory of a training step, traced on fake tensors; `ft-accum plan`
    memory               measured peak memory, out-of-memory detection, shrinking the micro-batch
    data_sources         local files and hub datasets, with errors that name the fix
    run_outputs          the output-dir guard, metrics.jsonl, atomic final/ save
"""

__version__ = "0.1.0"
