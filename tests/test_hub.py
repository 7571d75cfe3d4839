"""Saving, loading and pushing detectors; Hub traffic goes to a loopback server only.

``huggingface_hub`` reads ``HF_ENDPOINT`` when it is imported, so every client call runs in a fresh
subprocess whose environment (from ``LoopbackHub.client_env``) names the loopback server.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model
from hub_server import LoopbackHub
from huggingface_hub import ModelCard

from hf_gsc import GSCConfig, GSCForImageClassification


REPO_ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT = 120


@pytest.fixture
def base_dir(tmp_path) -> Path:
    directory = tmp_path / "base-vit"
    make_tiny_model("vit").float().save_pretrained(directory)
    return directory


def write_results(directory: Path, model: str, **settings) -> Path:
    """An evaluation output folder (results.json, results.md, a plot) of GSC with ``settings`` on ``model``."""
    (directory / "plots").mkdir(parents=True)
    metrics = {"fpr95": 0.25, "auroc": 0.9, "aupr_in": 0.8, "aupr_out": 0.85}
    config = GSCConfig(**settings)
    results = {
        "model": model,
        "benchmark": "fmnist-ood",
        "id_accuracy": 0.9,
        "methods": {"gsc": {"threshold": 1.0, "id_tpr_at_threshold": 0.95,
                            "hyperparameters": {name: getattr(config, name) for name in GSCConfig.score_names()},
                            "ood": {"mnist": metrics, "noise": {**metrics, "auroc": 0.99}}, "average": metrics}},
    }
    (directory / "results.json").write_text(json.dumps(results))
    (directory / "results.md").write_text("| method | mnist |\n|---|---|\n| gsc | 0.9 |\n")
    (directory / "plots" / "density_gsc.png").write_bytes(b"\x89PNG fake")
    return directory


def _files(hub: LoopbackHub, repo_id: str, revision: str = "main") -> set[str]:
    repo = hub.get_repo(repo_id)
    return set(repo.commits[hub._resolve_revision(repo, revision)].files)


def _pixel_values() -> torch.Tensor:
    return torch.randn(3, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(5))


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        env=env, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT, cwd=REPO_ROOT,
    )


def test_save_and_load_round_trip(base_dir, tmp_path):
    results_dir = write_results(tmp_path / "results", str(base_dir), mask_ratio=0.1, operation="perturb")
    detector = GSCForImageClassification.from_pretrained(base_dir, mask_ratio=0.1, operation="perturb")
    detector.calibrate(_pixel_values(), tpr=0.9)
    before = detector(_pixel_values())

    for save_base_model in (False, True):
        saved = tmp_path / f"detector-{save_base_model}"
        detector.save_pretrained(saved, save_base_model=save_base_model, results_dir=results_dir)
        assert (saved / "model.safetensors").exists() == save_base_model
        assert not list(saved.rglob("*.bin")) and not list(saved.rglob("*.pt")) and not list(saved.rglob("*.pkl"))
        loaded = GSCForImageClassification.from_pretrained(saved)
        # With its weights saved, the folder itself is the base model.
        expected = saved if save_base_model else detector.config.base_model_name_or_path
        assert loaded.config == dataclasses.replace(detector.config, base_model_name_or_path=str(expected))
        after = loaded(_pixel_values())
        torch.testing.assert_close(after.ood_score, before.ood_score, atol=0, rtol=0)
        assert after.is_ood.tolist() == before.is_ood.tolist()

    card = ModelCard.load(tmp_path / "detector-True" / "README.md")
    assert card.data.library_name == "hf_gsc"
    entries = card.data.eval_results
    assert {(e.dataset_config, e.metric_type) for e in entries} == {
        (split, metric) for split in ("mnist", "noise") for metric in ("auroc", "fpr95", "aupr_in", "aupr_out")
    }
    assert [e.metric_value for e in entries if e.dataset_config == "noise" and e.metric_type == "auroc"] == [0.99]
    # Calibrated on tensors: the card names them, and claims no split (nor "never on test") the library did not choose.
    assert "calibrated on 3 samples read from tensors given by the caller to keep" in card.text
    assert "never on test" not in card.text
    assert "plots/density_gsc.png" in card.text


def test_push_then_load_by_repo_id_end_to_end(base_dir, tmp_path):
    results_dir = write_results(tmp_path / "results", "user/base-vit", mask_ratio=0.1)
    with LoopbackHub() as hub:
        env = hub.client_env(hf_home=tmp_path / "hf_home", token=hub.token)
        pushed = _run(
            f"""
            import json, torch
            from huggingface_hub import HfApi
            from hf_gsc import GSCForImageClassification
            HfApi().create_repo("user/base-vit")
            HfApi().upload_folder(repo_id="user/base-vit", folder_path={str(base_dir)!r})
            x = torch.randn(3, 3, {IMAGE_SIZE}, {IMAGE_SIZE}, generator=torch.Generator().manual_seed(5))
            det = GSCForImageClassification.from_pretrained("user/base-vit", mask_ratio=0.1)
            det.calibrate(x, tpr=0.9)
            det.push_to_hub("user/gsc-tiny", private=True, results_dir={str(results_dir)!r})
            det.push_to_hub("user/gsc-tiny-full", save_base_model=True, revision="v1")
            print(json.dumps(det(x).ood_score.tolist()))
            """,
            env,
        )
        assert pushed.returncode == 0, pushed.stderr
        expected = json.loads(pushed.stdout.strip().splitlines()[-1])
        assert {"detector_config.json", "README.md", "results.json", "plots/density_gsc.png"} <= _files(hub, "user/gsc-tiny")
        assert "model.safetensors" in _files(hub, "user/gsc-tiny-full", revision="v1")

        load_script = f"""
            import json, torch
            from hf_gsc import GSCForImageClassification
            x = torch.randn(3, 3, {IMAGE_SIZE}, {IMAGE_SIZE}, generator=torch.Generator().manual_seed(5))
            a = GSCForImageClassification.from_pretrained("user/gsc-tiny")
            b = GSCForImageClassification.from_pretrained("user/gsc-tiny-full", revision="v1")
            print(json.dumps([a(x).ood_score.tolist(), b(x).ood_score.tolist(), a.config.calibration]))
            """
        loaded = _run(load_script, env)
        assert loaded.returncode == 0, loaded.stderr
        from_ref, from_full, calibration = json.loads(loaded.stdout.strip().splitlines()[-1])
        assert from_ref == expected and from_full == expected
        assert {key: calibration[key] for key in ("split", "source", "num_samples", "tpr", "method", "delta")} == {
            "split": None, "source": "tensors given by the caller", "num_samples": 3, "tpr": 0.9, "method": "quantile",
            "delta": None}
        # Loaded once, the detectors (and the referenced base) load again from the cache with HF_HUB_OFFLINE=1.
        offline = _run(load_script, {**env, "HF_HUB_OFFLINE": "1"})
        assert offline.returncode == 0, offline.stderr
        assert json.loads(offline.stdout.strip().splitlines()[-1]) == [expected, expected, calibration]

        # Without a token the private repo is invisible, and the error says so.
        anonymous = _run(
            """
            from hf_gsc import GSCForImageClassification
            try:
                GSCForImageClassification.from_pretrained("user/gsc-tiny")
            except Exception as error:
                print(type(error).__name__, error)
            """,
            hub.client_env(hf_home=tmp_path / "anon"),
        )
        # the Hub's own error, naming the repo (not "an image classifier, not a saved detector")
        assert anonymous.stdout.startswith("RepositoryNotFoundError") and "user/gsc-tiny" in anonymous.stdout
        assert "token" in anonymous.stdout

        script = _run(
            f"""
            import sys
            sys.argv = ["publish_to_hub.py", "--results-dir", {str(results_dir)!r}, "--repo-id", "user/results", "--private"]
            exec(open("scripts/publish_to_hub.py").read())
            """,
            env,
        )
        assert script.returncode == 0, script.stderr
        card = hub.read_file("user/results", "README.md").decode()
        entries = ModelCard(card).data.eval_results
        assert sorted({e.dataset_config for e in entries}) == ["mnist", "noise"]
        assert {"results.json", "results.md", "plots/density_gsc.png"} <= _files(hub, "user/results")
        writes = [r for r in hub.requests_log if r.method in ("POST", "PUT")]
        assert writes and all(r.authorization == f"Bearer {hub.token}" for r in writes)

        # The token never lands in a file we wrote or in our output.
        for output in (pushed, loaded, script):
            assert hub.token not in output.stdout + output.stderr
        for path in list(tmp_path.rglob("*")):
            if path.is_file() and path.name != "token":
                assert hub.token.encode() not in path.read_bytes(), path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.parametrize("failure", ["offline", "unreachable"])
def test_push_failure_is_clear_and_keeps_local_files(failure, base_dir, tmp_path):
    saved = tmp_path / "saved"
    GSCForImageClassification.from_pretrained(base_dir).save_pretrained(saved)
    snapshot = {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    with LoopbackHub() as hub:
        env = hub.client_env(hf_home=tmp_path / "hf_home", token=hub.token)
    if failure == "offline":
        env["HF_HUB_OFFLINE"] = "1"
    else:
        env["HF_ENDPOINT"] = f"http://127.0.0.1:{_free_port()}"
    result = _run(
        f"""
        from hf_gsc import GSCForImageClassification
        from hf_gsc.storage.publish_results import HubError
        det = GSCForImageClassification.from_pretrained({str(saved)!r})
        try:
            det.push_to_hub("user/never", save_base_model=True)
        except HubError as error:
            print("HubError:", error)
        """,
        env,
    )
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip().splitlines()[-1]
    expected = "HF_HUB_OFFLINE=1" if failure == "offline" else "could not push to 'user/never' at http://127.0.0.1"
    assert message.startswith("HubError:") and expected in message
    assert {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()} == snapshot
    assert env["HF_TOKEN"] not in result.stdout + result.stderr


@pytest.mark.parametrize("failure", ["offline", "unreachable"])
def test_a_failed_push_writes_nothing_before_raising(failure, monkeypatch):
    """The Hub is reached before the detector (and the base model's shards) is written to the temporary folder."""
    from huggingface_hub import constants

    import hf_gsc.storage.push
    from hf_gsc import AutoOODDetector
    from hf_gsc.storage.publish_results import HubError

    if failure == "offline":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    else:
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_free_port()}")
    written = []
    monkeypatch.setattr(hf_gsc.storage.push, "save_detector", lambda *args, **kwargs: written.append(args))
    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="energy")
    with pytest.raises(HubError, match="could not push to 'user/never'"):
        detector.push_to_hub("user/never", save_base_model=True, token="hf_x")
    assert written == []


def test_pushing_an_unfitted_detector_is_refused_before_the_hub_is_reached(monkeypatch):
    import hf_gsc.storage.push
    from hf_gsc import AutoOODDetector

    monkeypatch.setattr(hf_gsc.storage.push, "create_hub_repo", lambda *args, **kwargs: pytest.fail("the Hub was reached"))
    detector = AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="knn")
    with pytest.raises(ValueError, match=r"not fitted, so it cannot be saved: call \.fit\("):
        detector.push_to_hub("user/never", save_base_model=True)
