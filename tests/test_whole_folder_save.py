"""A detector folder is saved as a unit: a save killed at every file boundary leaves the old folder or the new one,
never a mix (MSP's threshold over KNN's calibration scores, a new config beside an old base's weights); what a
killed save left behind is cleaned by the next one; files a save does not own are kept."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import transformers
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import AutoOODDetector
from hf_gsc.utils import whole_folders


pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the kill is simulated in a forked process")


def _pixels(count: int, seed: int) -> torch.Tensor:
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


def _killed_after(events: int, save) -> bool:
    """Run ``save`` in a forked process killed (``os._exit``, no cleanup) just before its ``events``-th file lands
    (``os.replace``, ``os.rename``, the folders' exchange, transformers' writes of the base); whether it finished
    first."""
    pid = os.fork()
    if pid == 0:  # the child: count the boundaries, die at the chosen one
        seen = [0]

        def boundary(real):
            def wrapped(*args, **kwargs):
                seen[0] += 1
                if seen[0] == events:
                    os._exit(7)
                return real(*args, **kwargs)
            return wrapped

        os.replace, os.rename = boundary(os.replace), boundary(os.rename)
        whole_folders.exchange = boundary(whole_folders.exchange)
        # transformers writes the base's files itself: each of its writes is a boundary too
        transformers.PreTrainedModel.save_pretrained = boundary(transformers.PreTrainedModel.save_pretrained)
        transformers.PretrainedConfig.save_pretrained = boundary(transformers.PretrainedConfig.save_pretrained)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                save()
        except BaseException:
            os._exit(3)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code in (0, 7), f"the save failed otherwise (exit {code})"
    return code == 0


def _load(folder, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a mix would be dropped with a warning: none may come
        return AutoOODDetector.from_pretrained(folder, **kwargs)


def _kill_at_every_boundary(folder, save, check_old, check_new):
    """Kill ``save`` at its 1st, 2nd, ... boundary until it finishes; after each kill the folder is the old one
    (``check_old``), or the new one once the swap happened (``check_new``)."""
    events, finished, states = 1, False, []
    while not finished:
        finished = _killed_after(events, save)
        loaded = _load(folder)
        states.append("new" if check_new(loaded) else "old" if check_old(loaded) else "MIXED")
        events += 1
        assert events < 200
    assert "MIXED" not in states, states
    assert states[0] == "old" and states[-1] == "new" and states == sorted(states, key=["old", "new"].index), states
    parent = folder.parent
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{folder.name}.")]  # leftovers cleaned
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]
    return states


def test_saving_msp_over_a_knn_folder_killed_anywhere_leaves_one_detector(tmp_path):
    model = make_tiny_model("resnet")
    knn = AutoOODDetector.from_pretrained(model, method="knn", k=3)
    knn.fit([_pixels(40, seed=0)])
    knn.calibrate(_pixels(120, seed=1))
    msp = AutoOODDetector.from_pretrained(model, method="msp")
    msp.calibrate(_pixels(200, seed=2))
    folder = tmp_path / "detector"
    knn.save_pretrained(folder, save_base_model=True)
    (folder / "notes.txt").write_text("mine")
    # A killed save of an older version left these inside the folder.
    (folder / ".README.md.0123456789ab.tmp").write_text("half")
    (folder / ".staging.xyz").mkdir()

    def is_(detector, expected):
        return (detector.method == expected.method and detector.config.threshold == expected.config.threshold
                and torch.equal(detector.calibration_scores, expected.calibration_scores))

    states = _kill_at_every_boundary(folder, lambda: msp.save_pretrained(folder, save_base_model=True),
                                     lambda d: is_(d, knn), lambda d: is_(d, msp))
    assert len(states) >= 7, states  # the boundaries were reached one by one
    assert (folder / "notes.txt").read_text() == "mine"  # not the save's: kept
    assert not (folder / "README.md").read_text().count("knn")


def test_saving_onto_another_base_model_killed_anywhere_never_pairs_the_new_config_with_the_old_weights(tmp_path):
    first, second = make_tiny_model("resnet", seed=0), make_tiny_model("resnet", seed=1)
    second.save_pretrained(tmp_path / "second_base")
    second = type(second).from_pretrained(tmp_path / "second_base")
    old = AutoOODDetector.from_pretrained(first, method="energy")
    old.calibrate(_pixels(120, seed=3))
    new = AutoOODDetector.from_pretrained(second, method="energy")
    new.calibrate(_pixels(120, seed=3))
    assert new.config.base_model_name_or_path == str(tmp_path / "second_base")
    folder = tmp_path / "detector"
    old.save_pretrained(folder, save_base_model=True)
    x = _pixels(4, seed=4)
    with torch.no_grad():
        old_scores, new_scores = old.score(x), new.score(x)

    def scores_like(expected):
        def check(detector):
            with torch.no_grad():
                return torch.allclose(detector.score(x), expected) and (
                    detector.config.threshold == (old if expected is old_scores else new).config.threshold)
        return check

    _kill_at_every_boundary(folder, lambda: new.save_pretrained(folder), scores_like(old_scores),
                            scores_like(new_scores))
    assert not (folder / "model.safetensors").exists()  # the old base's weights did not stay beside the new config


def test_without_an_atomic_exchange_the_old_folder_waits_beside_and_comes_back(tmp_path, monkeypatch):
    """Where the system cannot exchange two folders, the old one is renamed aside and the new one in; a kill
    between the two leaves the old one beside (``.NAME.old.*``), and the next write puts it back before writing."""
    monkeypatch.setattr(whole_folders, "exchange", lambda first, second: False)
    folder = tmp_path / "detector"
    folder.mkdir()
    (folder / "a.json").write_text("old")
    (folder / "notes.txt").write_text("mine")
    with whole_folders.written_whole(folder, keep=lambda name: name == "notes.txt") as staged:
        (staged / "a.json").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["detector"]
    assert (folder / "a.json").read_text() == "new" and (folder / "notes.txt").read_text() == "mine"
    # Killed between the two renames: the name is absent, the old folder waits beside it.
    os.rename(folder, tmp_path / ".detector.old.0123456789ab")
    with pytest.raises(RuntimeError):
        with whole_folders.written_whole(folder, keep=lambda name: True) as staged:
            assert (folder / "a.json").read_text() == "new"  # put back before anything is written
            raise RuntimeError("the writer fails")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["detector"]
    assert (folder / "a.json").read_text() == "new"
