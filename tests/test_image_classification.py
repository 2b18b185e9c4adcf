"""recipes/image_classification.py: BatchNorm under accumulation, demonstrated, and the recipe end to end.

The data is scikit-learn's digits (real 8×8 scans the package ships), a few dozen of them, on the
recipe's own small ResNet built from a config: fp32, no dropout, so runs differ only in summation
order unless the normalisation itself differs.
"""

import json

import pytest
import torch
from conftest import (
    assert_same_run,
    copy_checkpoint,
    error_of,
    final_weights,
    launch,
    max_abs_difference,
    read_metrics,
    relative_error,
    run_in_process,
)

from ft_accum.models.norm import (
    apply_batchnorm_policy,
    convert_batchnorm_to_groupnorm,
    find_batchnorm,
    freeze_batchnorm,
    group_count,
)


def image_args(output_dir, **overrides):
    settings = {
        "max_train_samples": 64,
        "max_eval_samples": 32,
        "image_size": 16,
        "num_train_epochs": 1,
        "learning_rate": 0.01,
        "lr_scaling": "none",
        "num_warmup_steps": 0,
        "weight_decay": 0.0,
        "output_dir": output_dir,
        "report_to": "none",
        "seed": 3,
    }
    settings.update(overrides)
    return [f"--{k}={v}" for k, v in settings.items() if v is not None]


def test_batchnorm_breaks_accumulation_and_groupnorm_or_freezing_restore_it(tmp_path):
    """The same 64 digits, (micro 8, accumulation 1) against (micro 2, accumulation 4), for each
    --batchnorm. BatchNorm normalises each micro-batch with its own statistics, so kept it gives
    another model; GroupNorm (per sample) and frozen BN (running statistics) give the same one."""
    errors = {}
    for policy in ("keep", "groupnorm", "freeze"):
        for micro, accumulation in [(8, 1), (2, 4)]:
            run_in_process(
                "image_classification",
                image_args(
                    tmp_path / f"{policy}-{micro}x{accumulation}",
                    batchnorm=policy,
                    per_device_train_batch_size=micro,
                    gradient_accumulation_steps=accumulation,
                ),
            )
        errors[policy] = relative_error(
            final_weights(tmp_path / f"{policy}-2x4"), final_weights(tmp_path / f"{policy}-8x1")
        )
    assert errors["keep"] > 1e-3, errors
    assert errors["groupnorm"] <= 1e-5, errors
    assert errors["freeze"] <= 1e-5, errors


def test_groupnorm_conversion_keeps_the_affine_weights_and_divides_the_channels():
    from transformers import ResNetConfig, ResNetForImageClassification

    model = ResNetForImageClassification(
        ResNetConfig(embedding_size=12, hidden_sizes=[12, 40], depths=[1, 1], layer_type="basic")
    )
    bns = {name: model.get_submodule(name) for name in find_batchnorm(model)}
    with torch.no_grad():
        for bn in bns.values():
            bn.weight.uniform_()
    assert convert_batchnorm_to_groupnorm(model) == len(bns) > 0
    assert find_batchnorm(model) == []
    for name, bn in bns.items():
        gn = model.get_submodule(name)
        assert isinstance(gn, torch.nn.GroupNorm) and gn.num_channels % gn.num_groups == 0
        assert torch.equal(gn.weight, bn.weight)
    assert (group_count(12), group_count(40), group_count(64), group_count(256), group_count(7)) == (3, 10, 16, 32, 1)


def test_frozen_batchnorm_ignores_train_mode_and_keeps_its_statistics():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    freeze_batchnorm(model)
    before = model[1].running_mean.clone()
    model.train()
    model(torch.randn(8, 1, 6, 6))
    assert torch.equal(model[1].running_mean, before)


def test_the_policy_warns_on_kept_batchnorm_and_notes_a_model_without_it():
    with_bn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    assert "NOT equivalent" in apply_batchnorm_policy(with_bn, "keep", gradient_accumulation_steps=4)
    assert apply_batchnorm_policy(with_bn, "keep", gradient_accumulation_steps=1) is None
    assert apply_batchnorm_policy(torch.nn.Linear(2, 2), "groupnorm", 4).startswith("notice:")


@pytest.fixture(scope="module")
def mixed_mode_folders(tmp_path_factory):
    """An imagefolder whose PNGs mix grayscale, RGB, RGBA and palette images, plus a validation
    folder with a class the training folder lacks."""
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    generator = torch.Generator().manual_seed(0)
    modes = ["L", "RGB", "RGBA", "P"]
    for split, classes in (("train", ["cat", "dog"]), ("validation", ["cat", "dog"]), ("unseen", ["cat", "bird"])):
        for label in classes:
            (root / split / label).mkdir(parents=True)
            for i in range(8):
                pixels = (torch.rand(12, 10, 3, generator=generator) * 255).to(torch.uint8).numpy()
                Image.fromarray(pixels, "RGB").convert(modes[i % 4]).save(root / split / label / f"{i}.png")
    return root


def test_an_image_folder_with_mixed_modes_trains(tmp_path, mixed_mode_folders, capsys):
    results = run_in_process(
        "image_classification",
        image_args(
            tmp_path,
            train_dir=mixed_mode_folders / "train",
            validation_dir=mixed_mode_folders / "validation",
            max_train_samples=None,
            max_eval_samples=None,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
        ),
    )
    assert results["num_update_steps"] == 2 and 0.0 <= results["eval_accuracy"] <= 1.0
    assert "warning: the model has 9 BatchNorm layers in training mode" in capsys.readouterr().out


def test_groupnorm_on_a_model_without_batchnorm_is_a_notice_and_a_pretrained_model_loads(tmp_path, capsys):
    """A tiny ViT saved with its image processor stands for a pretrained hub model."""
    import transformers
    from transformers import ViTConfig, ViTForImageClassification

    image_processor_class = getattr(transformers, "ViTImageProcessorPil", transformers.ViTImageProcessor)

    model_dir = tmp_path / "tiny-vit"
    config = ViTConfig(
        image_size=16, patch_size=4, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    ViTForImageClassification(config).save_pretrained(model_dir)
    image_processor_class(size={"height": 16, "width": 16}).save_pretrained(model_dir)
    run_in_process(
        "image_classification",
        image_args(
            tmp_path / "out",
            model_name_or_path=model_dir,
            batchnorm="groupnorm",
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            max_train_steps=2,
        ),
    )
    assert "notice: --batchnorm groupnorm: the model has no BatchNorm layers" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        ({"label_column": "digit"}, ["--label_column 'digit' is not a column", "image, label"]),
        ({"image_column": "pixels"}, ["--image_column 'pixels' is not a column"]),
        ({"train_dir": "/no/such/folder"}, ["--train_dir /no/such/folder is not a folder"]),
        ({"batchnorm": "layernorm"}, ["--batchnorm must be one of keep, groupnorm, freeze"]),
    ],
)
def test_bad_image_inputs_stop_with_one_line(tmp_path, overrides, fragments):
    message = error_of("image_classification", image_args(tmp_path, **overrides))
    for fragment in fragments:
        assert fragment in message, message


def test_a_validation_class_the_training_folder_lacks_is_named(tmp_path, mixed_mode_folders):
    message = error_of(
        "image_classification",
        image_args(
            tmp_path,
            train_dir=mixed_mode_folders / "train",
            validation_dir=mixed_mode_folders / "unseen",
            max_train_samples=None,
            max_eval_samples=None,
        ),
    )
    assert "bird" in message, message


def test_resume_and_pipeline(tmp_path):
    """A run checkpointed at update 3 of 6 (in-process), resumed from that checkpoint in a fresh
    folder, ends bit-identical; the saved model loads into pipeline()."""
    common = {
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 4,
        "max_train_samples": 96,
        "batchnorm": "groupnorm",
    }
    run_in_process("image_classification", image_args(tmp_path / "full", checkpointing_steps=3, **common))
    resumed = copy_checkpoint(tmp_path / "full", 3, tmp_path / "resumed")
    run_in_process("image_classification", image_args(resumed, resume_from_checkpoint="latest", **common))
    assert [r["step"] for r in read_metrics(resumed)] == [4, 5, 6]
    assert max_abs_difference(final_weights(resumed), final_weights(tmp_path / "full")) == 0.0
    assert json.loads((tmp_path / "full" / "all_results.json").read_text())["num_update_steps"] == 6

    from PIL import Image
    from transformers import pipeline

    prediction = pipeline("image-classification", model=str(tmp_path / "full" / "final"))(Image.new("L", (8, 8)))
    assert prediction[0]["label"] in [str(d) for d in range(10)]


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(tmp_path):
    """41 digits in windows of 2 micro × 2 accumulation × 2 processes (GroupNorm: per-sample, so
    exact): process 1 gets only Accelerate's repeated rows in the last window, and counts none."""
    common = {"max_train_samples": 41, "batchnorm": "groupnorm", "optim": "sgd", "learning_rate": 0.1}
    run_in_process("image_classification", image_args(tmp_path / "one", per_device_train_batch_size=8, **common))
    launch(
        "image_classification",
        image_args(tmp_path / "ddp", per_device_train_batch_size=2, gradient_accumulation_steps=2, **common),
        num_processes=2,
    )
    assert json.loads((tmp_path / "ddp" / "all_results.json").read_text())["num_processes"] == 2
    assert [m["samples_seen"] for m in read_metrics(tmp_path / "ddp")] == [8, 16, 24, 32, 40, 41]
    assert_same_run(tmp_path / "ddp", tmp_path / "one")
