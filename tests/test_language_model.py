"""Language models beside classifiers: the gpt model, the text and tokens data and their splits, the task's checks,
and the task's figures (validation loss and perplexity) where a user reads them: status, metrics.jsonl, Prometheus
and the report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.control.memory import MemoryState
from coordinator.control.sqlite import SqliteState
from coordinator.display import format_status
from coordinator.jobs import validate_job
from coordinator.report import ReportError, write_report
from coordinator.simulate import simulate
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.algorithms.base import FlatParameters
from nodeagent.jobspec import JobSpecError, ModelSpec, parse_job_spec
from nodeagent.metrics import Metrics
from nodeagent.runtime.messages import from_node_progress, from_report, to_report
from nodeagent.runtime.progress import LOG_FILE, Progress
from nodeagent.training.data import DataError
from nodeagent.training.models import build_model
from nodeagent.training.splits import split_indices
from nodeagent.training.tasks import task_of
from nodeagent.training.tokens import TextOptions, TokensOptions, load_tokens

pytestmark = pytest.mark.unit

SENTENCES = ("alpha beta gamma delta ", "one two three four five ", "red green blue ", "north south east west ")


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    for index, sentence in enumerate(SENTENCES):
        (directory / f"doc{index}.txt").write_text(sentence * 40)
    (directory / ".hidden").write_text("left out")
    return directory


def lm_job(data_dir: Path, **changes) -> dict:
    job = {"name": "lm", "task": "language-model", "nodes": 4, "steps": 12, "eval_every": 6, "seed": 1,
           "algorithm": {"name": "dsgd", "lr": 0.3, "interval": 2},
           "model": {"name": "gpt", "options": {"layers": 1, "heads": 2, "width": 32}},
           "data": {"dataset": "text", "data_dir": str(data_dir), "split": "by-file", "batch_size": 4,
                    "options": {"sequence_length": 16}, "test_limit": 32}}
    for key, value in changes.items():
        job[key] = value
    return job


# -- the model ---------------------------------------------------------------------------------------------------


def test_gpt_is_a_causal_decoder_with_tied_weights() -> None:
    torch.manual_seed(0)
    model = build_model(ModelSpec(name="gpt", options={"layers": 2, "heads": 2, "width": 32}), (16,), 50)
    tokens = torch.randint(0, 50, (3, 16))
    logits = model(tokens)
    assert logits.shape == (3, 16, 50)
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 50
    model.eval()
    assert torch.equal(model(tokens)[:, :10], model(changed)[:, :10]), "a position sees no later token"
    assert not torch.equal(model(tokens)[:, 10:], model(changed)[:, 10:])
    assert model.head.weight is model.token_embedding.weight
    flat = FlatParameters(model)  # what the algorithms exchange: the tied matrix once
    assert flat.numel == sum(p.numel() for p in model.parameters())
    assert flat.numel < sum(p.numel() for p in model.state_dict().values())


def test_gpt_defaults_are_laptop_sized_and_take_a_longer_context() -> None:
    model = build_model(ModelSpec(name="gpt"), (64,), 256)
    assert 300_000 < sum(p.numel() for p in model.parameters()) < 3_000_000
    longer = build_model(ModelSpec(name="gpt", options={"context_length": 128, "width": 32, "heads": 2}), (64,), 256)
    assert longer(torch.zeros(2, 100, dtype=torch.long)).shape == (2, 100, 256)


@pytest.mark.parametrize(("options", "shape", "message"), [
    ({"width": 30, "heads": 4}, (16,), "width 30 must be a multiple of heads 4"),
    ({"layers": 0}, (16,), "layers must be a positive integer"),
    ({"dropout": 1.0}, (16,), "dropout must be in"),
    ({"context_length": 8}, (16,), "context_length must be an integer >= the data's sequence_length 16"),
    ({}, (1, 28, 28), "gpt needs token sequences"),
])
def test_gpt_refuses_options_and_data_that_do_not_fit(options, shape, message) -> None:
    with pytest.raises(ValueError, match=message):
        build_model(ModelSpec(name="gpt", options=options), shape, 256)


# -- the data ----------------------------------------------------------------------------------------------------


def test_text_samples_are_byte_windows_of_one_file_with_each_file_s_tail_for_validation(text_dir: Path) -> None:
    options = TextOptions(sequence_length=16, validation_fraction=0.25)
    train = load_tokens("text", text_dir, "train", options)
    test = load_tokens("text", text_dir, "test", options)
    assert train.info.num_classes == 256 and train.info.input_shape == (16,)
    assert train.info.train_samples == len(train) and train.info.test_samples == len(test)
    sizes = [len(sentence) * 40 for sentence in SENTENCES]
    assert len(test.tokens) == sum(int(size * 0.25) for size in sizes)
    assert len(train.tokens) == sum(size - int(size * 0.25) for size in sizes)
    for data in (train, test):
        assert sorted(set(data.groups.tolist())) == [0, 1, 2, 3]
        inputs, targets = data.batch(np.arange(len(data)))
        assert torch.equal(inputs[:, 1:], targets[:, :-1]), "targets are the next tokens"
        for row, last, group in zip(inputs, targets[:, -1], data.groups, strict=True):
            window = bytes([*row.tolist(), int(last)]).decode()
            assert window in SENTENCES[group] * 40, "a window lies within its own file"


def test_a_limited_validation_set_holds_some_of_every_file(text_dir: Path) -> None:
    test = load_tokens("text", text_dir, "test", TextOptions(sequence_length=8), limit=8)
    assert len(test) == 8 and sorted(set(test.groups.tolist())) == [0, 1, 2, 3]
    assert list(test.starts) == sorted(test.starts), "in order"


def test_text_data_may_be_one_file_and_refuses_what_is_not_utf8(tmp_path: Path, text_dir: Path) -> None:
    one = load_tokens("text", text_dir / "doc0.txt", "train", TextOptions(sequence_length=8))
    assert set(one.groups.tolist()) == {0}
    (text_dir / "binary.dat").write_bytes(b"\xff\xfe" * 100)
    with pytest.raises(DataError, match=r"binary\.dat: not UTF-8 text"):
        load_tokens("text", text_dir, "train", TextOptions(sequence_length=8))
    with pytest.raises(DataError, match="sequence_length"):
        load_tokens("text", text_dir / "doc0.txt", "train", TextOptions(sequence_length=4000))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_tokens_files_are_read_as_nanogpt_writes_them(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    written = {"train.bin": rng.integers(0, 900, 4000), "val.bin": rng.integers(0, 1000, 400)}
    written["val.bin"][7] = 70_000 if dtype == "uint32" else 999  # the largest token, in the validation file
    for name, tokens in written.items():
        (tmp_path / name).write_bytes(tokens.astype(dtype).tobytes())
    options = TokensOptions(sequence_length=32, dtype=dtype)
    train = load_tokens("tokens", tmp_path, "train", options)
    assert train.info.num_classes == int(written["val.bin"][7]) + 1, "the vocabulary: the largest token + 1"
    assert len(train) == (4000 - 1) // 32
    inputs, targets = train.batch(np.array([2]))
    expected = np.fromfile(tmp_path / "train.bin", dtype=dtype)[64:97].astype(np.int64)
    assert inputs[0].tolist() == expected[:32].tolist() and targets[0].tolist() == expected[1:].tolist()
    given = options.model_copy(update={"vocab_size": 80_000})
    assert load_tokens("tokens", tmp_path, "test", given).info.num_classes == 80_000
    with pytest.raises(DataError, match=r"is not below data\.options\.vocab_size 10"):
        load_tokens("tokens", tmp_path, "train", options.model_copy(update={"vocab_size": 10}))


def test_a_tokens_file_cut_short_is_refused(tmp_path: Path) -> None:
    (tmp_path / "train.bin").write_bytes(b"\x01\x00\x02")
    (tmp_path / "val.bin").write_bytes(b"\x01\x00")
    with pytest.raises(DataError, match="not a whole number of uint16 tokens"):
        load_tokens("tokens", tmp_path, "train", TokensOptions(sequence_length=2))


def test_by_file_gives_each_node_its_own_documents_and_iid_a_share_of_every_one(text_dir: Path) -> None:
    for split, files_per_node in (("by-file", {1}), ("iid", {4})):
        spec = parse_job_spec(lm_job(text_dir, data={**lm_job(text_dir)["data"], "split": split}))
        task = task_of(spec)
        train = task.load(spec, text_dir, "train")
        shards = task.shards(spec, train)
        assert sorted(np.concatenate(shards).tolist()) == list(range(len(train)))
        assert {len(set(train.groups[shard].tolist())) for shard in shards} == files_per_node, split


def test_by_file_keeps_files_whole_where_there_are_enough_and_cuts_them_where_there_are_not() -> None:
    files = np.repeat(np.arange(8), [50, 10, 10, 30, 40, 5, 5, 50])  # samples labelled by file, unequal files
    shards = split_indices(files, 4, "by-file", seed=0)
    assert [sorted(set(files[shard].tolist())) for shard in shards] == [[0], [1, 2, 3], [4, 5, 6], [7]]
    cut = split_indices(np.repeat([0, 1], 40), 4, "by-file", seed=0)
    assert [len(shard) for shard in cut] == [20, 20, 20, 20]


# -- the task's checks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("change", "field"), [
    ({"task": "classification"}, "data.dataset: text is language-model data"),
    ({"model": {"name": "logistic"}}, "model.name: logistic is not a language-model model"),
    ({"data": {"dataset": "text", "split": "class-window"}}, "data.split: the language-model task splits"),
    ({"data": {"dataset": "tokens", "split": "by-file"}}, "data.split: by-file needs text data"),
    ({"data": {"dataset": "text", "options": {"vocab_size": 10}}}, "data.options.vocab_size: unknown option"),
    ({"data": {"dataset": "text", "options": {"sequence_length": 0}}}, "data.options.sequence_length:"),
])
def test_a_job_whose_parts_do_not_fit_its_task_is_refused_naming_the_field(text_dir: Path, change, field) -> None:
    with pytest.raises(JobSpecError) as refusal:
        validate_job(parse_job_spec(lm_job(text_dir, **change)))
    assert str(refusal.value).startswith(field), str(refusal.value)


def test_a_classifier_cannot_train_gpt() -> None:
    with pytest.raises(JobSpecError, match=r"^model\.name: gpt is not a classification model"):
        validate_job(parse_job_spec({"model": {"name": "gpt"}}))


# -- the task's figures ------------------------------------------------------------------------------------------


def test_a_language_model_run_shows_its_perplexity_in_status_the_log_prometheus_and_the_report(
        text_dir: Path, tmp_path: Path) -> None:
    spec = parse_job_spec(lm_job(text_dir))
    metrics = Metrics()
    result = simulate(spec, run_dir=tmp_path / "run", metrics=metrics)
    progress = result.progress
    assert all(p.finished and p.test_perplexity == pytest.approx(math.exp(p.test_loss)) for p in progress)
    assert all(math.isnan(p.test_accuracy) for p in progress)

    status = format_status(progress, task="language-model")
    assert "val ppl" in status.splitlines()[0] and "test acc" not in status
    mean = sum(p.test_perplexity for p in progress) / len(progress)
    assert f"mean validation perplexity over 4 nodes: {mean:.3f}" in status

    lines = [json.loads(line) for line in (tmp_path / "run" / LOG_FILE).read_text().splitlines()]
    final = [line for line in lines if line["finished"]]
    assert final and all(line["test_perplexity"] > 1 and line["test_accuracy"] is None for line in final)

    registry = metrics.registry
    for p in progress:
        labels = {"job_id": spec.name, "node": p.node}
        assert registry.get_sample_value("peertrain_test_perplexity", labels) == pytest.approx(p.test_perplexity)
        assert registry.get_sample_value("peertrain_test_accuracy", labels) is None, "no accuracy series"

    page = write_report([tmp_path / "run"], tmp_path / "report").read_text()
    assert "final mean validation perplexity" in page and "final mean validation loss" in page
    assert (tmp_path / "report" / "perplexity_bytes.png").is_file()
    assert (tmp_path / "report" / "perplexity_steps.png").is_file()

    classifier = tmp_path / "classifier"  # a run of another task cannot share its figures
    classifier.mkdir()
    (classifier / "job.json").write_text(parse_job_spec({"name": "c"}).model_dump_json())
    (classifier / LOG_FILE).write_text((tmp_path / "run" / LOG_FILE).read_text())
    with pytest.raises(ReportError, match="runs of different tasks"):
        write_report([tmp_path / "run", classifier], tmp_path / "both")


def test_the_perplexity_travels_in_reports_and_status_and_an_older_message_has_none() -> None:
    progress = Progress(job="j", rank=1, node="n1", step=5, test_loss=2.0, test_perplexity=math.exp(2.0))
    assert from_report(to_report(progress), 0.0).test_perplexity == pytest.approx(math.exp(2.0))
    older = pb.NodeProgress(rank=1, node_id="n1", step=5, test_loss=2.0)  # from a coordinator before the field
    assert math.isnan(from_node_progress("j", older).test_perplexity)
    assert pb.JobStatusReply(task="language-model").task == "language-model"


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
def test_the_stores_keep_the_last_perplexity_between_evaluations(tmp_path: Path, text_dir: Path, kind: str) -> None:
    state = MemoryState() if kind == "memory" else SqliteState(tmp_path / "state.db")
    spec = parse_job_spec(lm_job(text_dir, nodes=1))
    state.add_job("j1", spec, "nodes: 1\n", str(tmp_path / "run"))
    state.start_job("j1", ["n0"])
    assert state.record_progress(Progress(job="j1", rank=0, node="n0", step=6, test_loss=2.0, test_perplexity=7.39))
    assert state.record_progress(Progress(job="j1", rank=0, node="n0", step=7))  # between evaluations
    (member,) = state.members("j1")
    assert member.progress.step == 7 and member.progress.test_perplexity == pytest.approx(7.39)
