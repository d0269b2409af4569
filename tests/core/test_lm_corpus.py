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
