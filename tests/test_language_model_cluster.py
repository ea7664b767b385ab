"""Language models on real agents: a nanoGPT token file and a directory of text files, each trained by a small
job on the shared cluster at once, with the task's figures (validation loss and perplexity) in the status, the
run's metrics.jsonl and its report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from coordinator.display import status_text
from coordinator.report import write_report
from nodeagent._proto import coordinator_pb2 as pb
from nodeagent.runtime.progress import LOG_FILE

pytestmark = pytest.mark.cluster


def write_corpus(root: Path) -> tuple[Path, Path]:
    """A text directory of 2 documents, and train.bin / val.bin of uint16 tokens with a repeating pattern."""
    text = root / "text"
    text.mkdir(parents=True, exist_ok=True)
    (text / "a.txt").write_text("the agents train a language model on their own documents.\n" * 40)
    (text / "b.md").write_text("# Notes\nperplexity falls as the model learns the text.\n" * 40)
    tokens = root / "tokens"
    tokens.mkdir(exist_ok=True)
    pattern = np.tile(np.arange(0, 600, 7, dtype=np.uint16), 60)  # 86 tokens that always follow one another
    pattern.tofile(tokens / "train.bin")
    pattern[:2000].tofile(tokens / "val.bin")
    return text, tokens


def job(name: str, dataset: str, data_dir: Path, algorithm: dict, split: str) -> str:
    return yaml.safe_dump({
        "name": name, "task": "language-model", "nodes": 2, "steps": 30, "eval_every": 15,
        "algorithm": algorithm, "model": {"name": "gpt", "options": {"layers": 1, "heads": 2, "width": 32}},
        "data": {"dataset": dataset, "data_dir": str(data_dir), "split": split, "batch_size": 8,
                 "options": {"sequence_length": 16}, "test_limit": 64},
        "topology": {"kind": "ring"},
    })


def test_a_text_directory_and_a_tokens_file_train_on_agents_and_report_perplexity(cluster, tmp_path):
    text, tokens = write_corpus(tmp_path)
    jobs = {
        "text": cluster.submit(job("lm-text", "text", text, {"name": "dsgd", "lr": 0.3, "mode": "sync"}, "by-file")),
        "tokens": cluster.submit(job("lm-tokens", "tokens", tokens, {
            "name": "diloco", "lr": 0.003, "options": {"inner_steps": 15}}, "iid")),
    }
    for kind, job_id in jobs.items():
        status = cluster.wait(job_id, timeout_s=120)
        assert status.state == pb.JOB_FINISHED, (kind, status.reason)
        assert status.task == "language-model"
        run = Path(status.run_dir)
        records = [json.loads(line) for line in (run / LOG_FILE).read_text().splitlines()]
        first = {r["rank"]: r["test_loss"] for r in records if r["step"] == 0 and r["test_loss"] is not None}
        for node in status.nodes:
            assert node.step == 30
            assert math.isnan(node.test_accuracy)
            assert node.test_perplexity == pytest.approx(math.exp(node.test_loss))
            assert node.test_loss < first[node.rank] - 0.5, (kind, node.rank, first[node.rank], node.test_loss)
        final = [r for r in records if r["finished"]]
        assert final and all(r["test_perplexity"] > 1 and r["test_accuracy"] is None for r in final)
        shown = status_text(status)
        assert "val ppl" in shown and "mean validation perplexity over 2 nodes" in shown
    # Both runs in one report (its figures are what costs here): the table has each one's final perplexity.
    runs = [Path(cluster.status(job_id).run_dir) for job_id in jobs.values()]
    page = write_report(runs, tmp_path / "report").read_text()
    assert "final mean validation perplexity" in page and "lm-text" in page and "lm-tokens" in page
