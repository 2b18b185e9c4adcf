"""recipes/contrastive_embedding.py: its retrieval metrics, its sentence-transformers output, its one-line
errors, and DDP on rows that do not divide. GradCache's exactness is tests/test_embedding_cache.py's (dropout
on, hard negatives, the symmetric loss, 2 processes); the contract (8 × 1 = 2 × 4, resume) is
tests/test_recipe_contract.py's, on the recipe's own defaults."""

import json

import pytest
import torch
from conftest import assert_same_run, launch, read_metrics, run_in_process, tiny_args, write_jsonl

from ft_accum.testing import make_retrieval_pairs

SGD = {"optim": "sgd", "learning_rate": 0.05, "max_grad_norm": 0}


@pytest.fixture(scope="module")
def pair_files(tmp_path_factory):
    path = tmp_path_factory.mktemp("retrieval")
    return {"train": write_jsonl(path / "train.jsonl", make_retrieval_pairs(21, seed=1, negatives=True)),
            "validation": write_jsonl(path / "validation.jsonl", make_retrieval_pairs(10, seed=2))}  # fmt: skip


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tiny_model_dir, pair_files):
    """21 pairs with hard negatives in updates of 8 × 1 (8, 8, 5): every update one forward of all its pairs."""
    out = tmp_path_factory.mktemp("one")
    results = run_in_process(
        "contrastive_embedding", tiny_args(tiny_model_dir, pair_files, out, per_device_train_batch_size=8, **SGD)
    )
    return out, results


def test_retrieval_is_reported_before_and_after(one_process):
    _, results = one_process
    for name in ("recall@1", "mrr@10", "ndcg@10"):
        assert 0 < results[f"eval_{name}"] <= 1 and 0 < results[f"initial_eval_{name}"] <= 1
    # With one relevant document Recall@1 ≤ MRR@10 ≤ nDCG@10 (1/r ≤ 1/log2(1 + r) for r ≥ 1).
    assert results["eval_recall@1"] <= results["eval_mrr@10"] <= results["eval_ndcg@10"]


def test_final_loads_in_sentence_transformers_with_the_same_embeddings(one_process):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from transformers import AutoModel, AutoTokenizer

    from ft_accum.models.sentence_embedding import sentence_embeddings

    final = one_process[0] / "final"
    texts = ["markets shares profit rise", "the match ended in a late goal for the home team", "film"]
    theirs = sentence_transformers.SentenceTransformer(str(final), device="cpu").encode(texts, convert_to_tensor=True)
    tokenizer, model = AutoTokenizer.from_pretrained(final), AutoModel.from_pretrained(final).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        ours = sentence_embeddings(model, batch["input_ids"], batch["attention_mask"])
    assert theirs.shape == ours.shape
    # fp32, the same modules: only the padding differs (theirs pads per its own batch).
    assert float((theirs - ours).norm() / ours.norm()) <= 1e-5


def without_negatives(rows):
    return rows


def with_an_empty_positive(rows):
    rows[1]["positive"] = " "
    return rows


@pytest.mark.parametrize(
    "flags, train_rows, expected",
    [
        ({"positive_column": "nope"}, None, "--positive_column 'nope' is not a column"),
        ({}, with_an_empty_positive, "row 2 of the train split has an empty 'positive'"),
        ({"per_device_train_batch_size": 1, "effective_batch_size": 1}, without_negatives, "no negative"),
        ({"scale": 0}, None, "--scale must be > 0"),
        ({"auto_micro_batch": True}, None, "--auto_micro_batch"),
    ],
    ids=["missing column", "empty positive", "one pair", "scale 0", "auto micro-batch"],
)
def test_bad_input_is_one_line(tmp_path, tiny_model_dir, pair_files, flags, train_rows, expected):
    files = dict(pair_files)
    if train_rows:  # pairs without a hard negative, edited
        files["train"] = write_jsonl(tmp_path / "train.jsonl", train_rows(make_retrieval_pairs(6, seed=3)))
    with pytest.raises(SystemExit) as exit_info:
        run_in_process("contrastive_embedding", tiny_args(tiny_model_dir, files, tmp_path / "out", **flags))
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and expected in message and "\n" not in message, message


@pytest.mark.launch
def test_two_ddp_processes_match_one_process_when_the_rows_do_not_divide(
    tmp_path, tiny_model_dir, pair_files, one_process
):
    """21 pairs with hard negatives in updates of 2 micro × 2 accumulation × 2 processes (8, 8, 5): each
    process caches its two micro-batches, the loss is over both processes' pairs, and in the short last
    window process 1 holds 2 real pairs and a micro-batch of repeats. The same updates as one forward of
    every pair of each update (the one-process run at 8 × 1)."""
    ddp = tmp_path / "ddp"
    launch("contrastive_embedding", tiny_args(tiny_model_dir, pair_files, ddp, per_device_train_batch_size=2,
           gradient_accumulation_steps=2, **SGD), num_processes=2)  # fmt: skip
    assert json.loads((ddp / "all_results.json").read_text())["num_processes"] == 2
    assert [m["samples_seen"] for m in read_metrics(ddp)] == [8, 16, 21]
    assert_same_run(ddp, one_process[0])
