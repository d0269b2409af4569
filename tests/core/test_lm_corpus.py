"""The language model's corpus from a store URI (components/tasks/lm.py): prepare lists the text files
under the prefix on moto's S3 server and reads them through the store, committing the same sequences
as the same files in a folder; a missing bucket or a prefix with nothing to read is one line, exit 2."""

from __future__ import annotations

import numpy as np
import pytest

from relaunch.components.core.contract.classify import classify
from relaunch.components.core.contract.config import RelaunchConfig
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.data import commit_task_data
from relaunch.components.core.data.shards import iter_rows
from relaunch.components.core.store import open_store
from relaunch.components.tasks.lm import make_task
from tests.core.helpers import s3_root

FILES = {f"pkg/mod{i:02d}.py": f"def f{i}(x):\n    return x * {i}  # naïve\n" * 12 for i in range(16)}
FILES |= {"README.md": "# a corpus\n" + "some text. " * 60, "notes/a.txt": "plain text\n" * 40}
LEFT_OUT = {"pkg/data.bin": "\0" * 500, ".git/hidden.py": "x = 1\n" * 50, "pkg/__pycache__/mod00.py": "y\n" * 50}


def lm_config(corpus: str, store: str) -> RelaunchConfig:
    return RelaunchConfig.model_validate({"store": {"uri": store}, "train": {
        "task": "relaunch.components.tasks.lm:make_task",
        "task_options": {"corpus": corpus, "seq_len": 32, "d_model": 32, "n_heads": 2}}})


def test_a_corpus_under_an_s3_prefix_is_prepared_through_the_store_as_the_same_folder_is(s3_env, tmp_path):
    uri = s3_root(s3_env, "corpus")
    bucket = open_store(uri)
    folder = tmp_path / "corpus"
    for rel, text in (FILES | LEFT_OUT).items():
        bucket.write_bytes(rel, text.encode())
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)

    from_s3 = make_task(lm_config(uri, str(tmp_path / "a"))).build_dataset()
    from_folder = make_task(lm_config(str(folder), str(tmp_path / "b"))).build_dataset()
    assert from_s3.meta["corpus"]["root"] == uri and from_s3.meta["corpus"]["files"] == len(FILES)
    assert from_s3.meta["corpus"]["bytes"] == sum(len(t.encode()) for t in FILES.values())
    assert from_s3.source_key == from_folder.source_key  # the same files, wherever they are
    store = open_store(str(tmp_path / "datasets"))
    manifest, written = commit_task_data(make_task(lm_config(uri, str(tmp_path / "a"))), store)
    assert written > 0 and manifest.meta["documents"] == from_folder.meta["documents"]
    for split in ("train", "val", "test"):
        stored = np.concatenate([rows["tokens"] for rows in iter_rows(store, manifest, split)])
        built = np.concatenate([chunk["tokens"] for chunk in from_folder.splits[split]()])
        assert stored.shape[1] == 33 and np.array_equal(stored, built), split
    again, written_again = commit_task_data(make_task(lm_config(uri, str(tmp_path / "a"))), store)
    assert (again.version, written_again) == (manifest.version, 0)


@pytest.mark.parametrize("where,words", [
    ("s3://relaunch-no-such-bucket/corpus", "does not exist"),
    ("s3://relaunch-ckpt/nothing-here-{}", "no .py, .txt, .md file under it"),
    ("file://{tmp}/empty", "no .py, .txt, .md file under it"),
])
def test_a_missing_bucket_or_a_prefix_with_nothing_to_read_is_one_line_exit_2(s3_env, tmp_path, where, words):
    s3_env.create_bucket("relaunch-ckpt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.bin").write_bytes(b"\0" * 100)
    uri = where.format(tmp_path.name, tmp=tmp_path)
    with pytest.raises(BadInput) as caught:
        make_task(lm_config(uri, str(tmp_path / "store"))).build_dataset()
    message = str(caught.value)
    assert "\n" not in message and f"train.task_options.corpus={uri!r}" in message and words in message
    assert int(classify(caught.value)) == 2


def test_a_folder_is_read_on_a_thread_into_the_same_sequences_and_key_as_the_corpus_read_whole(tmp_path):
    """prepare reads a folder's files straight into their splits' sequences (SplitReader) as the shards
    are cut: the chunks and the source key are those of windows() over the corpus read whole, a NUL
    of the text made SUB after it is hashed."""
    from relaunch.components.tasks.lm import BYTES, read_corpus, split_of, windows

    folder = tmp_path / "corpus"
    for rel, text in (FILES | {"pkg/nul.py": "a\0b = 1\n" * 30}).items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    source = make_task(lm_config(str(folder), str(tmp_path / "store"))).build_dataset()
    assert not source.key_known_early
    corpus = read_corpus(str(folder), 4_000_000)
    rule = source.meta["split"]
    header = repr((BYTES.describe(), 32, rule)).encode()
    assert source.source_key == f"lm-bytes-xxh3-{corpus.key(header)}"
    for split in ("train", "val", "test"):
        docs = [corpus.doc(i) for i, rel in enumerate(corpus.names)
                if split_of(rel, rule["val_fraction"], rule["test_fraction"], rule["split_seed"]) == split]
        whole = [c["tokens"] for c in windows(docs, 32, chunk=5)]
        streamed = [c["tokens"] for c in source.splits[split].func(split, 5)]  # chunks of 5 sequences
        assert len(whole) == len(streamed) > 0 and all(np.array_equal(a, b) for a, b in zip(whole, streamed)), split
    assert (folder / "pkg/nul.py").read_bytes().count(b"\0") == 30  # the files as they were


def test_a_file_that_shrinks_while_prepare_reads_it_is_one_line_exit_2_and_no_version_is_committed(tmp_path):
    from relaunch.components.core.data.shards import PREFIX

    folder = tmp_path / "corpus"
    for rel, text in FILES.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text(text)
    task = make_task(lm_config(str(folder), str(tmp_path / "store")))
    source = task.build_dataset()  # listed: sizes known
    (folder / "pkg/mod15.py").write_text("x")  # shorter than listed, before the reader reaches it
    store = open_store(str(tmp_path / "store"))
    from relaunch.components.core.data.shards import commit_source

    with pytest.raises(BadInput) as caught:
        commit_source(store, source)
    assert "changed while prepare read it" in str(caught.value) and int(classify(caught.value)) == 2
    assert not [key for key in store.list(PREFIX) if key.endswith("MANIFEST.json")]
