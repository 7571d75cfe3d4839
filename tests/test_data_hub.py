"""Data loaders against the loopback Hub: a Hub dataset id in ``load_split`` and the Fashion-MNIST fallback to
``zalando-datasets/fashion_mnist`` when the Debian files are missing.

The loaders run in a subprocess because ``datasets`` and ``huggingface_hub`` read ``HF_ENDPOINT`` at import.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import datasets
import numpy as np
import pytest
from hub_server import LoopbackHub
from PIL import Image


REPO_ROOT = Path(__file__).resolve().parents[1]
HUB_ID = "zalando-datasets/fashion_mnist"


def _split(num_images: int, seed: int) -> tuple[np.ndarray, list[int], datasets.Dataset]:
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (num_images, 28, 28), dtype=np.uint8)
    labels = rng.integers(0, 10, num_images).tolist()
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)})
    dataset = datasets.Dataset.from_dict({"image": [Image.fromarray(i) for i in images], "label": labels}, features)
    return images, labels, dataset


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=300, cwd=REPO_ROOT)


@pytest.fixture()
def hub():
    with LoopbackHub() as server:
        server.orgs = {server.user: ["zalando-datasets"]}
        yield server


def test_fashion_mnist_without_debian_files_or_hub_names_both(hub, tmp_path):
    env = hub.client_env(hf_home=tmp_path / "hf")
    env["HF_GSC_FASHION_MNIST_DIR"] = str(tmp_path / "empty")  # no idx files: the Hub is tried, and has no repo
    result = _run("from hf_gsc.data import fashion_mnist; fashion_mnist.load_arrays()", env)
    assert result.returncode != 0
    assert "FileNotFoundError" in result.stderr and "apt-get install dataset-fashion-mnist" in result.stderr


def test_hub_dataset_id_and_fashion_mnist_fallback(hub, tmp_path):
    train_images, train_labels, train = _split(12, 0)
    test_images, test_labels, test = _split(8, 1)
    folder = tmp_path / "upload"
    (folder / "data").mkdir(parents=True)
    train.to_parquet(str(folder / "data" / "train-00000-of-00001.parquet"))
    test.to_parquet(str(folder / "data" / "test-00000-of-00001.parquet"))
    with hub.patch_client(token=hub.token):
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(HUB_ID, repo_type="dataset")
        api.upload_folder(folder_path=str(folder), repo_id=HUB_ID, repo_type="dataset")

    env = hub.client_env(hf_home=tmp_path / "hf")  # anonymous, as a user without a token
    env["HF_GSC_FASHION_MNIST_DIR"] = str(tmp_path / "empty")
    result = _run(
        """
        import json
        import numpy as np
        from hf_gsc.data import fashion_mnist
        from hf_gsc.data.splits import load_split

        split = load_split("zalando-datasets/fashion_mnist:test")
        raw = fashion_mnist._raw()  # the Debian directory is empty: the Hub fallback
        print(json.dumps({
            "columns": split.column_names,
            "split_labels": list(split["label"]),
            "split_images": [np.asarray(image).tolist() for image in split["image"]],
            "raw": {name: [images.tolist(), labels.tolist()] for name, (images, labels) in raw.items()},
        }))
        """,
        env,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["columns"] == ["image", "label"]
    assert out["split_labels"] == test_labels
    np.testing.assert_array_equal(np.array(out["split_images"], dtype=np.uint8), test_images)
    for name, images, labels in (("train", train_images, train_labels), ("test", test_images, test_labels)):
        np.testing.assert_array_equal(np.array(out["raw"][name][0], dtype=np.uint8), images)
        assert out["raw"][name][1] == labels
    assert not hub.unhandled_requests()
