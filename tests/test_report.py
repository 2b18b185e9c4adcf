"""`ft-accum report`: plots and a table rendered from real short runs."""

import pytest
from conftest import run_in_process, tiny_args

from ft_accum.cli.main import main as cli_main

pytest.importorskip("matplotlib")


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, tiny_model_dir, data_files):
    root = tmp_path_factory.mktemp("report-runs")
    for name, accumulation in (("accum2", 2), ("accum4", 4)):
        run_in_process(
            "text_classification",
            tiny_args(
                tiny_model_dir,
                data_files,
                root / "sweep" / name,
                per_device_train_batch_size=4,
                gradient_accumulation_steps=accumulation,
                num_train_epochs=2,
                measure_noise_scale=True,
            ),
        )
    return root / "sweep"


def test_a_report_of_one_run_has_every_plot_and_the_table(two_runs, capsys):
    cli_main(["report", str(two_runs / "accum2")])
    report = two_runs / "accum2" / "report"
    for name in ("loss.png", "lr.png", "grad_norm.png", "throughput.png", "noise_scale.png"):
        png = (report / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000, name
    text = (report / "report.md").read_text()
    assert "| accum2 | 8 | 4 × 2 | 12 |" in text and "eval_accuracy" in text and "![Gradient noise scale" in text
    assert "wrote" in capsys.readouterr().out


def test_a_sweep_folder_overlays_its_runs(two_runs):
    cli_main(["report", str(two_runs), "--out", str(two_runs / "compare")])
    text = (two_runs / "compare" / "report.md").read_text()
    assert "2 runs" in text and "| accum2 |" in text and "| accum4 |" in text
    assert (two_runs / "compare" / "loss.png").stat().st_size > 10_000


def test_a_folder_without_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit) as error:
        cli_main(["report", str(tmp_path)])
    assert str(error.value).startswith("error: ") and "holds no metrics.jsonl" in str(error.value)
