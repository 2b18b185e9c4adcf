r"""accelerate launch --config_file accelerate_configs/cpu.yaml recipes/image_classification.py \
    --config recipes/configs/image_classification.yaml

Train an image classifier with exact gradient accumulation, BatchNorm included.

With no flags it trains a small ResNet (built from a config: no pretrained vision weights are
available offline, so it trains from scratch) on scikit-learn's 1,797 real handwritten digits,
which that PyPI package carries. Point it at your own data with --train_dir (an `imagefolder`:
one sub-folder per class) or --dataset_name, and at a pretrained model with --model_name_or_path.

BatchNorm is not equivalent under accumulation: it normalises each micro-batch on its own and
moves its running statistics once per micro-batch. --batchnorm groupnorm (from scratch) or
--batchnorm freeze (pretrained) make the run exact; keep warns (see ft_accum/models/norm.py).

The settings that matter:
- --effective_batch_size (or --gradient_accumulation_steps): the update is computed over
  effective = per_device_train_batch_size × gradient_accumulation_steps × processes images.
- --learning_rate is the LR that is right at --base_batch_size; --lr_scaling adapts it.
- Precision and processes come from the Accelerate config (accelerate_configs/), not from here.

Outputs in --output_dir: final/ (save_pretrained, with an image-processor config for pipeline()),
metrics.jsonl, all_results.json, checkpoints/step_XXXXXX/ (with --checkpointing_steps).
SIGTERM or Ctrl-C finishes the current update, saves a checkpoint and prints the resume command.
"""

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
import transformers
from accelerate.utils import set_seed
from transformers import AutoImageProcessor, AutoModelForImageClassification, ResNetConfig

from ft_accum.core.errors import ConfigError
from ft_accum.data import data_sources, offline_assets
from ft_accum.data.metrics import load_metric
from ft_accum.models import loading, low_memory, norm
from ft_accum.training import run_setup
from ft_accum.training.arguments import run_main

# transformers ≥ 5 has the PIL backend, which needs no torchvision, as a class of its own.
ImageProcessor = getattr(transformers, "ViTImageProcessorPil", transformers.ViTImageProcessor)


@dataclass
class TaskArguments:
    model_name_or_path: Optional[str] = field(
        default=None,
        metadata={
            "help": "Pretrained image classifier (local dir or hub name). "
            "Default: a small ResNet from a config, trained from scratch."
        },
    )
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "Hub image dataset (needs network). Default: scikit-learn's digits (offline)."}
    )
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Config of --dataset_name."})
    train_dir: Optional[str] = field(
        default=None, metadata={"help": "Local imagefolder: one sub-folder of images per class."}
    )
    validation_dir: Optional[str] = field(
        default=None, metadata={"help": "Local imagefolder for evaluation; default: 10%% of train."}
    )
    image_column: str = field(default="image", metadata={"help": "Column holding the image."})
    label_column: str = field(default="label", metadata={"help": "Column holding the label (int or string)."})
    image_size: int = field(
        default=32,
        metadata={
            "help": "Images are resized to image_size × image_size (a pretrained model's processor overrides it)."
        },
    )
    batchnorm: str = field(
        default="keep",
        metadata={
            "help": "BatchNorm under accumulation: keep (not exact; warns), groupnorm (convert: exact, for "
            "training from scratch) or freeze (running statistics: exact, for pretrained models)."
        },
    )

    def __post_init__(self):
        if self.image_size < 1:
            raise ConfigError(f"--image_size must be ≥ 1, got {self.image_size}")
        if self.batchnorm not in norm.POLICIES:
            raise ConfigError(f"--batchnorm must be one of {', '.join(norm.POLICIES)}, got {self.batchnorm!r}")
        if self.train_dir and self.dataset_name:
            raise ConfigError("give --train_dir or --dataset_name, not both")


NO_DECAY = ("bias", "normalization.weight", "LayerNorm.weight", "layernorm.weight")


def build_model(task, args, label_names):
    labels = {
        "num_labels": len(label_names),
        "id2label": dict(enumerate(label_names)),
        "label2id": {n: i for i, n in enumerate(label_names)},
    }
    if task.model_name_or_path:
        # A head trained for another label set is replaced (transformers prints which weights).
        model = loading.load_pretrained(
            AutoModelForImageClassification,
            task.model_name_or_path,
            args.trust_remote_code,
            ignore_mismatched_sizes=True,
            **labels,
        )
        processor = loading.load_pretrained(AutoImageProcessor, task.model_name_or_path, args.trust_remote_code)
        size = processor.size.get("shortest_edge") or processor.size.get("height") or task.image_size
        processor = ImageProcessor(
            size={"height": size, "width": size}, image_mean=processor.image_mean, image_std=processor.image_std
        )
    else:  # ResNet-10-like, 0.08M parameters: BatchNorm after every convolution
        config = ResNetConfig(
            num_channels=3,
            embedding_size=16,
            hidden_sizes=[16, 32, 64],
            depths=[1, 1, 1],
            layer_type="basic",
            **labels,
        )
        model = AutoModelForImageClassification.from_config(config)
        processor = ImageProcessor(
            size={"height": task.image_size, "width": task.image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
        )
    model = loading.cast_and_compile(model, args.model_dtype, args.torch_compile)
    if args.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ConfigError(f"{type(model).__name__} does not support --gradient_checkpointing; drop the flag")
        loading.enable_gradient_checkpointing(model)
    return model, processor


def load_raw_data(task, args):
    if task.train_dir:
        raw = data_sources.load_image_folder(task.train_dir, task.validation_dir)
    elif task.dataset_name:
        raw = data_sources.load_hub_dataset(task.dataset_name, task.dataset_config_name)
    else:
        raw = offline_assets.load_digits_images(seed=args.seed)
    raw = data_sources.with_validation_split(raw, args.seed)
    raw = data_sources.check_columns(raw, image_column=task.image_column, label_column=task.label_column)
    raw = data_sources.take_first_rows(raw, train=args.max_train_samples, validation=args.max_eval_samples)
    return raw, data_sources.label_names(raw, task.label_column)


def build_dataloaders(task, args, raw, processor, label_names, pixel_dtype):
    is_class_label = hasattr(raw["train"].features[task.label_column], "names")
    label_ids = {name: i for i, name in enumerate(label_names)}
    size = (processor.size["height"], processor.size["width"])
    mean, std = torch.tensor(processor.image_mean).view(3, 1, 1), torch.tensor(processor.image_std).view(3, 1, 1)

    def to_tensor(image):
        # Grayscale, palette and RGBA images all become RGB: a folder may mix modes.
        pixels = torch.frombuffer(bytearray(image.convert("RGB").tobytes()), dtype=torch.uint8).view(
            image.height, image.width, 3
        )
        pixels = F.interpolate(
            pixels.permute(2, 0, 1)[None].float() / 255, size=size, mode="bilinear", align_corners=False
        )[0]
        return (pixels - mean) / std

    def transform(rows):  # on the fly, per batch: nothing is materialised on disk
        labels = rows[task.label_column]
        return {
            "pixel_values": [to_tensor(image) for image in rows[task.image_column]],
            "labels": labels if is_class_label else [label_ids[str(v)] for v in labels],
        }

    def collate(rows):
        return {
            # In the weights' dtype: a bf16 model (--model_dtype bfloat16) takes bf16 images, not fp32 ones.
            "pixel_values": torch.stack([r["pixel_values"] for r in rows]).to(pixel_dtype),
            "labels": torch.tensor([r["labels"] for r in rows]),
        }

    data = raw.with_transform(transform)
    # Generators of their own keep the run bit-identical across a resume (see seeded_dataloaders).
    return data_sources.seeded_dataloaders(
        data, collate, args.per_device_train_batch_size, args.per_device_eval_batch_size, args.seed
    )


def evaluate_model(model, eval_dataloader, accelerator, accuracy, f1):
    model.eval()
    loss_sum, count = 0.0, 0
    for batch in eval_dataloader:
        with torch.no_grad():
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        # gather_for_metrics drops the samples Accelerate repeated to even out the last batch.
        logits, labels = accelerator.gather_for_metrics((logits, batch["labels"]))
        loss_sum += F.cross_entropy(logits, labels, reduction="sum").item()
        count += len(labels)
        predictions = logits.argmax(-1)
        accuracy.add_batch(predictions=predictions, references=labels)
        f1.add_batch(predictions=predictions, references=labels)
    model.train()
    return {
        "eval_loss": loss_sum / count,
        "eval_accuracy": accuracy.compute()["accuracy"],
        "eval_macro_f1": f1.compute(average="macro")["f1"],
    }


def count_items(batch):
    """What the loss is a mean over: the micro-batch's images (the window sums them before any forward)."""
    return len(batch["labels"])


def training_step(model, batch):
    """The micro-batch's summed loss: not a mean, the window divides once by its count of all images."""
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
    return F.cross_entropy(logits, batch["labels"], reduction="sum")


def train(task, args):
    accelerator, plan = run_setup.build_accelerator(task, args, "image_classification")
    if not task.model_name_or_path:  # refused before the data loads, not at prepare
        run_setup.refuse_under_fsdp(accelerator, "the default ResNet (no input embeddings, 0.08M parameters)")
    offload = low_memory.offload_activations(args.offload_activations, accelerator.device)
    set_seed(args.seed)

    raw, label_names = load_raw_data(task, args)
    model, processor = build_model(task, args, label_names)
    # Before the optimizer sees the parameters: --batchnorm groupnorm replaces modules.
    if notice := norm.apply_batchnorm_policy(model, task.batchnorm, plan.accumulation, plan.processes):
        accelerator.print(notice)
    train_dataloader, eval_dataloader = build_dataloaders(task, args, raw, processor, label_names, model.dtype)
    run_setup.fit_fsdp_units(accelerator, model)  # under FSDP: which modules shard together
    optimizer = run_setup.build_optimizer(model, args=args, plan=plan, no_decay=NO_DECAY)
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )
    rows = {"train / eval images": f"{len(raw['train'])} / {len(raw['validation'])}", "BatchNorm": task.batchnorm}
    train_windows, lr_scheduler, tracker = run_setup.start_training(
        accelerator,
        args,
        plan,
        model=model,
        optimizer=optimizer,
        train_dataloader=train_dataloader,
        count_items=count_items,
        banner_rows=rows,
    )
    metrics = load_metric("accuracy"), load_metric("f1")
    tracker.evaluate_before_training(evaluate_model, model, eval_dataloader, accelerator, *metrics)
    model.train()
    for window in train_windows:  # one optimizer update; window.num_items: its images, on every process
        for batch in window:
            with accelerator.accumulate(model), offload, window.retry_on_out_of_memory():
                loss_sum = training_step(model, batch)
                # Σ loss / num_items over the window: scale = N·P / num_items undoes backward's ÷N and DDP's ÷P
                accelerator.backward(loss_sum * window.scale)
                window.add_loss(loss_sum)
                if accelerator.sync_gradients:  # the window's last micro-batch: a NaN loss stops before the step
                    window.check_finite_loss()
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm or math.inf)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        tracker.end_update(window, grad_norm=grad_norm)
        if window.evaluation_due:  # an epoch's end, or every --eval_steps updates
            tracker.evaluate(evaluate_model, model, eval_dataloader, accelerator, *metrics)
    return tracker.finish(model, tokenizer=processor)


def main(argv=None):
    return run_main(
        train,
        TaskArguments,
        argv,
        __doc__,
        output_dir="outputs/image_classification",
        metric_for_best_model="eval_accuracy",
    )


if __name__ == "__main__":
    main()
