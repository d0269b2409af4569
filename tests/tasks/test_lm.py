"""The language-model task (components/tasks/lm.py): its tokenizer, corpus, model and metrics, on the
real standard library and small real models; no pipeline."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.config_loading import load_config
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.tasks.lm import (BYTES, BYTES_EOS_256, EOS, NUL_AS, VOCAB_SIZE, decode, encode, make_task,
                                          sequences)

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16}
"""A model small enough to train a few steps in a test."""


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: a second intra-op thread only waits for the first on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def lm_config(data: dict | None = None, **options) -> RelaunchConfig:
    return RelaunchConfig.model_validate({"data": data or {}, "train": {
        "task": "relaunch.components.tasks.lm:make_task", "lr": 3e-3, "task_options": options}})


class Split:
    """What evaluate is handed: the split's sequences in stored order, in batches."""

    def __init__(self, tokens: np.ndarray):
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def batches(self, batch_size: int):
        for i in range(0, len(self.tokens), batch_size):
            yield {"tokens": torch.from_numpy(self.tokens[i:i + batch_size])}


def small_model(seed: int = 0, **options):
    task = make_task(lm_config(**{**SMALL, **options}))
    torch.manual_seed(seed)
    return task, task.build_model()


def fixed_batch(n: int = 8, seq_len: int = 16) -> np.ndarray:
    text = (ROOT / "components" / "tasks" / "lm.py").read_bytes()[:n * (seq_len + 1)]
    return encode(text).reshape(n, seq_len + 1).copy()  # encode's tokens are a view of the bytes: read-only


def test_the_byte_tokenizer_round_trips_a_text_in_uint8_and_decode_skips_the_end_of_document_token():
    text = "def f(x):\n    return x  # naïve, 数据 ✓\n"
    tokens = encode(text)
    assert (VOCAB_SIZE, EOS) == (256, 0)
    assert tokens.dtype == np.uint8 and len(tokens) == len(text.encode())
    assert decode(tokens) == text
    assert decode(np.concatenate([tokens, [EOS], tokens])) == text + text


def test_a_nul_byte_of_the_text_becomes_sub_never_an_end_of_document_token(tmp_path):
    assert NUL_AS == 0x1A
    assert encode("a\0b").tolist() == [ord("a"), NUL_AS, ord("b")]
    assert decode(encode("a\0b")) == "a\x1ab"
    (tmp_path / "0.txt").write_bytes(b"x\0y\0\0z")
    (tmp_path / "1.txt").write_bytes(b"\0abc")
    chunks = list(sequences([(tmp_path / "0.txt", 6), (tmp_path / "1.txt", 4)], seq_len=1, chunk=2))
    got = np.concatenate([c["tokens"] for c in chunks]).ravel()
    assert got.tolist() == list(b"x\x1ay\x1a\x1az") + [EOS] + list(b"\x1aabc") + [EOS]
    assert (tmp_path / "0.txt").read_bytes() == b"x\0y\0\0z"  # the file's bytes as they were


def test_the_tokenizer_of_datasets_prepared_before_is_read_with_its_end_of_document_token_256():
    assert BYTES_EOS_256.describe() == {"kind": "bytes", "vocab_size": 257, "eos": 256}
    tokens = BYTES_EOS_256.encode("a\0b")
    assert tokens.dtype == np.uint16 and tokens.tolist() == [97, 0, 98]  # NUL was a byte like any other
    assert BYTES_EOS_256.decode([97, 0, 256, 98]) == "a\0b"
    with pytest.raises(BadInput, match="is not one the LM task reads"):
        BYTES.of({"kind": "bpe", "vocab_size": 50257}, "data.version=x")


def test_sequences_are_the_documents_joined_by_end_of_document_tokens_cut_into_windows(tmp_path):
    docs = [b"first document\n", b"x" * 40, b"third document"]  # 72 tokens: 14 windows of 5
    paths = []
    for i, doc in enumerate(docs):
        (tmp_path / f"{i}.txt").write_bytes(doc)
        paths.append((tmp_path / f"{i}.txt", len(doc)))
    chunks = list(sequences(paths, seq_len=4, chunk=3))
    flat = np.concatenate([list(d) + [EOS] for d in docs])
    got = np.concatenate([c["tokens"] for c in chunks])
    assert [len(c["tokens"]) for c in chunks] == [3, 3, 3, 3, 2] and got.shape == (14, 5) and got.dtype == np.uint8
    assert np.array_equal(got.ravel(), flat[:14 * 5])

    # each chunk in memory of its own (the source says fresh_chunks: the writer keeps them without a copy)
    assert not any(np.shares_memory(a["tokens"], b["tokens"]) for a, b in zip(chunks, chunks[1:]))

def test_the_configured_stdlib_corpus_splits_deterministically_and_every_split_holds_sequences():
    config = load_config(ROOT / "configs" / "lm.yaml")
    assert config.train.task == "relaunch.components.tasks.lm:make_task"
    assert set(config.train.task_options) <= set(make_task(config).options)  # each one the task reads
    first, second = make_task(config).build_dataset(), make_task(config).build_dataset()
    assert first.source_key == second.source_key and first.fresh_chunks
    seq_len = first.meta["seq_len"]
    for name in ("train", "val", "test"):
        a = np.concatenate([c["tokens"] for c in first.splits[name]()])
        b = np.concatenate([c["tokens"] for c in second.splits[name]()])
        assert a.dtype == np.uint8 and a.shape[1] == seq_len + 1 and len(a) > 0, name
        assert np.array_equal(a, b), name
    assert first.meta["tokenizer"] == {"kind": "bytes", "vocab_size": 256, "eos": 0, "nul_as": 0x1A}
    assert all(first.meta["documents"][name] > 0 for name in ("train", "val", "test"))


def test_the_same_options_give_the_same_source_key_and_a_changed_seq_len_or_split_another():
    key = make_task(lm_config(max_corpus_bytes=300_000)).build_dataset().source_key
    assert make_task(lm_config(max_corpus_bytes=300_000)).build_dataset().source_key == key
    assert make_task(lm_config(max_corpus_bytes=300_000, seq_len=64)).build_dataset().source_key != key
    assert make_task(lm_config({"split_seed": 1}, max_corpus_bytes=300_000)).build_dataset().source_key != key


def test_a_folder_corpus_is_read_and_a_changed_file_changes_the_source_key(tmp_path):
    for i in range(40):
        (tmp_path / f"doc{i:02d}.md").write_text(f"# document {i}\n" + "some text. " * 30)
    (tmp_path / "skipped.bin").write_bytes(b"\0" * 10_000)
    task = make_task(lm_config(corpus=str(tmp_path), seq_len=32))
    source = task.build_dataset()
    assert source.meta["corpus"]["files"] == 40
    assert sum(len(c["tokens"]) for c in source.splits["train"]()) > 0
    (tmp_path / "doc00.md").write_text("changed")
    assert task.build_dataset().source_key != source.source_key


@pytest.mark.parametrize("options,words", [
    ({"corpus": "/no/such/folder"}, "corpus='/no/such/folder' is neither 'stdlib' nor an existing folder"),
    ({"max_corpus_bytes": 1000}, "raise max_corpus_bytes"),
    ({"d_model": 130}, "d_model=130 must be divisible by n_heads=4"),
    ({"n_layers": 0}, "n_layers=0 must be a whole number >= 1"),
    ({"dropout": 1.5}, "dropout=1.5 must be a number in"),
])
def test_bad_options_or_a_corpus_too_small_are_refused_in_one_line_naming_them(options, words):
    with pytest.raises(BadInput, match=words.replace("(", r"\(").replace("[", r"\[")):
        make_task(lm_config(**options)).build_dataset()


def test_the_output_head_is_tied_to_the_token_embedding_and_the_state_dict_holds_both():
    task, model = small_model()
    assert model.head.weight is model.tok_emb.weight
    state = model.state_dict()
    assert state["head.weight"].data_ptr() == state["tok_emb.weight"].data_ptr()
    assert state["tok_emb.weight"].shape == (VOCAB_SIZE, SMALL["d_model"])
    assert task.options.keys() >= set(SMALL)


def test_shard_blocks_returns_the_transformer_blocks():
    task, model = small_model()
    blocks = task.shard_blocks(model)
    assert len(blocks) == SMALL["n_layers"] and all(b is m for b, m in zip(blocks, model.blocks))


def test_a_few_optimizer_steps_on_fixed_batches_lower_the_loss():
    task, model = small_model()
    optimizer = task.build_optimizer(model)
    scheduler = task.build_scheduler(optimizer, total_steps=20)
    batch = {"tokens": torch.from_numpy(fixed_batch())}
    losses = []
    for _ in range(20):
        loss = task.loss(model, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB_SIZE), abs=0.5)  # about uniform at the start
    assert losses[-1] < losses[0] - 1.0


def test_evaluate_returns_finite_loss_perplexity_and_token_accuracy_over_the_whole_split():
    task, model = small_model()
    tokens = fixed_batch(n=70)  # two batches of evaluate's 64
    metrics = task.evaluate(model, Split(tokens))
    assert set(metrics) == {"loss", "perplexity", "token_accuracy"}
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["perplexity"] == math.exp(metrics["loss"])
    assert 0.0 <= metrics["token_accuracy"] <= 1.0
    assert model.training  # left as it was found
    whole = task.loss(model.eval(), {"tokens": torch.from_numpy(tokens)}).item()
    assert metrics["loss"] == pytest.approx(whole, rel=1e-5)


def test_serve_gives_the_same_greedy_continuation_every_time_for_each_input_form():
    import pandas as pd

    task, model = small_model(max_new_tokens=8)
    _, twin = small_model(max_new_tokens=8)
    prompts = task.example_input()
    out = task.serve(model, prompts)
    assert len(out) == len(prompts) and all(isinstance(s, str) for s in out)
    assert task.serve(model, prompts) == out == task.serve(twin, prompts)
    assert task.serve(model, pd.DataFrame({"prompt": prompts})) == out
    assert task.serve(model, pd.Series(prompts)) == out
    assert task.serve(model, pd.DataFrame(prompts)) == out  # what MLflow hands a list[str] signature's predict
    with pytest.raises(BadInput, match="list of strings"):
        task.serve(model, [1, 2])


def test_score_is_the_mean_token_loss_of_each_text_and_longer_than_the_context_works():
    task, model = small_model()
    text = "import os\n"
    tokens = np.concatenate([[EOS], encode(text)]).astype(np.int64)[None]
    direct = task.loss(model.eval(), {"tokens": torch.from_numpy(tokens)}).item()
    long, short, empty = task.score(model, [text * 10, text, ""])
    assert short == pytest.approx(direct, rel=1e-5)
    assert math.isfinite(long) and math.isnan(empty)


def test_a_bf16_autocast_forward_on_cpu_gives_a_finite_loss_and_gradients():
    task, model = small_model()
    batch = {"tokens": torch.from_numpy(fixed_batch())}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(batch["tokens"][:, :-1].long()).dtype == torch.bfloat16
        loss = task.loss(model, batch)
    loss.backward()
    assert loss.dtype == torch.float32 and math.isfinite(loss.item())
    assert model.tok_emb.weight.grad is not None and torch.isfinite(model.tok_emb.weight.grad).all()


def old_format_dataset(store, seq_len: int) -> str:
    """A dataset as prepare wrote it before the tokens were bytes: uint16 tokens, the end of a document
    256, its tokenizer {"kind": "bytes", "vocab_size": 257, "eos": 256} in the meta; its version."""
    from relaunch.components.core.data.shards import DatasetWriter

    files = sorted((ROOT / "components" / "core" / "contract").glob("*.py"))[:12]
    writer = DatasetWriter(store, meta={"tokenizer": {"kind": "bytes", "vocab_size": 257, "eos": 256},
                                        "seq_len": seq_len})
    for i, split in enumerate(("train", "val", "test")):
        flat = np.concatenate([np.append(np.frombuffer(f.read_bytes(), np.uint8).astype(np.uint16), 256)
                               for f in files[i::3] or files])
        writer.add(split, {"tokens": flat[:len(flat) // (seq_len + 1) * (seq_len + 1)].reshape(-1, seq_len + 1)})
    return writer.commit().version


def test_a_dataset_prepared_before_with_uint16_tokens_trains_evaluates_serves_and_registers_with_its_own_tokenizer(tmp_path):
    import mlflow

    from relaunch.components.core.data import open_split, open_training_data
    from relaunch.components.core.packaging.model import save_model
    from relaunch.components.core.store import open_store

    store_root = tmp_path / "store"
    store = open_store(str(store_root))
    version = old_format_dataset(store, SMALL["seq_len"])
    config = RelaunchConfig.model_validate({
        "store": {"uri": str(store_root)}, "data": {"version": version, "num_workers": 0},
        "train": {"task": "relaunch.components.tasks.lm:make_task", "lr": 3e-3, "global_batch_size": 8,
                  "max_steps": 12, "task_options": {**SMALL, "max_new_tokens": 8}}})
    task = make_task(config)
    assert task.tokenizer is BYTES_EOS_256
    torch.manual_seed(0)
    model = task.build_model()
    assert model.tok_emb.weight.shape == (257, SMALL["d_model"])

    data = open_training_data(config, task, store, version, 0, 1)  # the trainer's loader over its shards
    optimizer = task.build_optimizer(model)
    losses = []
    try:
        for step, batch in zip(range(12), data.loader.batches(0)):
            loss = task.loss(model, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        data.loader.close()
    assert len(losses) == 12 and losses[0] == pytest.approx(math.log(257), abs=0.5) and losses[-1] < losses[0]
    val = open_split(config, task, store, version, "val")
    assert int((np.asarray(val["tokens"]) == 256).sum()) > 0  # the old end-of-document token, the 257th
    metrics = task.evaluate(model, val)
    assert all(math.isfinite(v) for v in metrics.values())
    prompts = task.example_input()
    served = task.serve(model, prompts)
    assert math.isfinite(task.score(model, ["import os\n"])[0])

    save_model(config, "file:///unused", tmp_path / "model", task=task, model=model)
    (packaged,) = (tmp_path / "model").rglob("task_meta.json")
    assert json.loads(packaged.read_text()) == {"tokenizer": {"kind": "bytes", "vocab_size": 257, "eos": 256}}

    shutil.rmtree(store_root)  # the registered model serves with the tokenizer it was packaged with
    loaded = mlflow.pyfunc.load_model(str(tmp_path / "model"))
    assert list(loaded.predict(prompts)) == served
