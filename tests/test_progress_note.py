"""A quiet local read that takes a while says so: the first read of a tree of class folders (``datasets``'
imagefolder indexing every file) prints one line on stderr when it outlasts ``NOTE_AFTER_SECONDS`` and its duration
at the end, instead of minutes of silence; a quick read prints nothing."""

from __future__ import annotations

import time

import numpy as np
from PIL import Image

from hf_gsc.data import load_split
from hf_gsc.utils import progress


def _class_folders(root, classes=("cat", "dog"), per_class=3):
    for name in classes:
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            Image.fromarray(np.full((8, 8, 3), index * 40, dtype=np.uint8)).save(root / name / f"{index}.png")
    return root


def test_a_slow_folder_read_says_it_is_still_reading(tmp_path, monkeypatch, capsys):
    import datasets

    folder = _class_folders(tmp_path / "photos")
    load_dataset = datasets.load_dataset

    def slow_load(*args, **kwargs):  # a large tree, in miniature: the read outlasts the (shortened) delay
        loaded = load_dataset(*args, **kwargs)
        time.sleep(0.5)
        return loaded

    monkeypatch.setattr(datasets, "load_dataset", slow_load)
    monkeypatch.setattr(progress, "NOTE_AFTER_SECONDS", 0.05)
    rows = load_split(str(folder))
    err = capsys.readouterr().err
    assert len(rows) == 6
    assert "hf_gsc: still reading a local dataset folder (the first read of a folder of images lists and indexes" in err
    assert "hf_gsc: read a local dataset folder in " in err


def test_a_quick_read_prints_nothing(tmp_path, capsys):
    folder = _class_folders(tmp_path / "photos")
    assert progress.NOTE_AFTER_SECONDS >= 1
    load_split(str(folder))
    assert "hf_gsc:" not in capsys.readouterr().err
