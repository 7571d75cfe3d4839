"""The paper's benchmarks by name (``cifar10-ood``, ``cifar100-ood``, ``imagenet-ood``) against the loopback Hub.

Every Hub dataset a benchmark names is served by ``tests/hub_server.py`` as a tiny stand-in of the same schema
(same repo id, config, splits, column names and feature types; a few generated images), uploaded the way the real
repos store them: parquet files, or one zip of JPEGs for ``torch-uncertainty/inaturalist``. ImageNet-1k is gated
there as on the Hub. The loaders run in subprocesses because ``datasets`` and ``huggingface_hub`` read
``HF_ENDPOINT`` at import.
"""

from __future__ import annotations

import hashlib
import io
import json
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
from hub_server import LoopbackHub
from PIL import Image


REPO_ROOT = Path(__file__).resolve().parents[1]
CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
#: Rows per stand-in split; the content-hash hold-out keeps about 1 in 10 train rows, so train needs a few dozen.
SIZES = {"train": 40, "test": 6, "validation": 5}


def _images(count: int, seed: int, size: int = 8) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)) for _ in range(count)]


def _write_split(folder: Path, name: str, columns: dict, features: datasets.Features) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict(columns, features).to_parquet(str(folder / f"{name}-00000-of-00001.parquet"))


def _classified(folder: Path, splits: dict[str, int], image: str, labels: dict[str, datasets.ClassLabel], seed: int):
    features = datasets.Features({image: datasets.Image(), **labels})
    for offset, (split, count) in enumerate(splits.items()):
        rng = np.random.default_rng(seed + offset)
        columns = {image: _images(count, seed + offset)}
        columns.update({name: rng.integers(0, label.num_classes, count).tolist() for name, label in labels.items()})
        _write_split(folder / "data", split, columns, features)


def _unlabelled(folder: Path, split: str, count: int, seed: int) -> None:
    _write_split(folder / "data", split, {"image": _images(count, seed)}, datasets.Features({"image": datasets.Image()}))


def _stand_ins(root: Path) -> dict[str, Path]:
    """Folder to upload for each Hub dataset the named benchmarks use."""
    repos = {}
    cifar10 = repos["uoft-cs/cifar10"] = root / "cifar10"
    _classified(cifar10, {"train": SIZES["train"], "test": SIZES["test"]}, "img",
                {"label": datasets.ClassLabel(names=CIFAR10_NAMES)}, seed=0)
    cifar100 = repos["uoft-cs/cifar100"] = root / "cifar100"
    _classified(cifar100, {"train": SIZES["train"], "test": SIZES["test"]}, "img",
                {"fine_label": datasets.ClassLabel(names=[f"fine{i}" for i in range(100)]),
                 "coarse_label": datasets.ClassLabel(names=[f"coarse{i}" for i in range(20)])}, seed=10)
    svhn = repos["ufldl-stanford/svhn"] = root / "svhn"
    for config, seed in (("cropped_digits", 20), ("full_numbers", 25)):
        _classified(svhn / config, {"train": 3, "test": 4}, "image",
                    {"label": datasets.ClassLabel(names=[str(d) for d in range(10)])}, seed=seed)
        (svhn / config / "data").rename(svhn / config / "parts")
    (svhn / "README.md").write_text(
        "---\nconfigs:\n"
        + "".join(f"- config_name: {c}\n  data_files:\n  - split: train\n    path: {c}/parts/train-*\n"
                  f"  - split: test\n    path: {c}/parts/test-*\n" for c in ("cropped_digits", "full_numbers"))
        + "---\n"
    )
    dtd = repos["tanganke/dtd"] = root / "dtd"
    _classified(dtd, {"train": 3, "test": 2}, "image", {"label": datasets.ClassLabel(names=[f"t{i}" for i in range(47)])},
                seed=30)
    for repo_id, count, seed in (("detectors/lsun_c-ood", 4, 40), ("detectors/lsun_r-ood", 3, 41), ("detectors/isun-ood", 2, 42)):
        folder = repos[repo_id] = root / repo_id.replace("/", "_")
        _unlabelled(folder, "train", count, seed)
    imagenet = repos["ILSVRC/imagenet-1k"] = root / "imagenet"
    _classified(imagenet, {"train": SIZES["train"], "validation": SIZES["validation"]}, "image",
                {"label": datasets.ClassLabel(names=[f"n{i:08d}" for i in range(1000)])}, seed=50)
    inaturalist = repos["torch-uncertainty/inaturalist"] = root / "inaturalist"
    _zip_of_images(inaturalist / "inaturalist.zip", [f"inaturalist/images/{i}.jpg" for i in range(3)], seed=60)
    mnist = repos["ylecun/mnist"] = root / "mnist"
    _classified(mnist, {"train": 3, "test": 2}, "image", {"label": datasets.ClassLabel(names=[str(d) for d in range(10)])},
                seed=70)
    (mnist / "data").rename(mnist / "mnist")  # ylecun/mnist: mnist/{train,test}-00000-of-00001.parquet, config "mnist"
    (mnist / "README.md").write_text(
        "---\nconfigs:\n- config_name: mnist\n  data_files:\n  - split: train\n    path: mnist/train-*\n"
        "  - split: test\n    path: mnist/test-*\n---\n")
    # OpenOOD's sets stored as one archive of image files each (torch-uncertainty/*), read through OpenOOD's image
    # lists; every archive also holds images the lists leave out, which must not be loaded.
    for repo_id, archive, members, seed in (
        ("torch-uncertainty/tiny-imagenet-200", "tin.zip",
         [f"val/images/val_{i}.JPEG" for i in range(4)] + ["train/n01443537/images/n01443537_0.JPEG"], 80),
        ("torch-uncertainty/Places365", "places365.zip",
         [f"{c}/Places365_val_{i:08d}.jpg" for c, i in (("airfield", 1), ("bakery", 2), ("canyon", 3))], 81),
        ("torch-uncertainty/SSB_hard", "ssb_hard.zip",
         [f"n11622368/n11622368_{i}.JPEG" for i in (1063, 1120, 1250)], 82),
        ("torch-uncertainty/Ninco", "ninco.zip",
         [f"NINCO_OOD_classes/mbira/mbira_00{i}_1{i}.png" for i in range(3)]
         + ["NINCO_OOD_unit_tests/noise/noise_0.png"], 83),
        ("torch-uncertainty/Openimage-O", "openimage_o.zip", [f"openimage_o/{i:016x}.jpg" for i in (7, 8, 9)], 84),
    ):
        folder = repos[repo_id] = root / repo_id.replace("/", "_")
        _zip_of_images(folder / archive, members, seed)
    lists = repos["torch-uncertainty/ood-datasets-splits"] = root / "splits"
    lists.mkdir()
    with zipfile.ZipFile(lists / "splits.zip", "w") as archive:
        for member, listed in OPENOOD_LISTS.items():
            archive.writestr(f"splits/{member}", "".join(f"{path} -1\n" for path in listed))
    return repos


#: The OpenOOD image lists of the stand-in ``splits.zip``: a subset of each archive's images.
OPENOOD_LISTS = {
    "cifar10/test_tin.txt": ["val/images/val_0.JPEG", "val/images/val_1.JPEG", "val/images/val_3.JPEG"],
    "cifar100/test_tin.txt": ["val/images/val_0.JPEG", "val/images/val_2.JPEG"],
    "cifar10/test_places365.txt": ["airfield/Places365_val_00000001.jpg", "canyon/Places365_val_00000003.jpg"],
    "cifar100/test_places365.txt": ["bakery/Places365_val_00000002.jpg"],
    "imagenet1k/test_ssb_hard.txt": ["n11622368/n11622368_1063.JPEG", "n11622368/n11622368_1250.JPEG"],
    "imagenet1k/test_ninco.txt": [f"NINCO_OOD_classes/mbira/mbira_00{i}_1{i}.png" for i in range(3)],
    "imagenet1k/test_openimage_o.txt": [f"{i:016x}.jpg" for i in (7, 9)],
}


def _zip_of_images(path: Path, members: list[str], seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as archive:
        for member, image in zip(members, _images(len(members), seed, size=16)):
            encoded = io.BytesIO()
            image.save(encoded, format="PNG" if member.endswith(".png") else "JPEG")
            archive.writestr(member, encoded.getvalue())


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("stand_ins")
    repos = _stand_ins(root)
    with LoopbackHub(tokens={"hf_owner": "owner", "hf_granted": "granted", "hf_stranger": "stranger"}) as server:
        server.orgs = {"owner": sorted({repo_id.split("/")[0] for repo_id in repos})}
        with server.patch_client(token="hf_owner"):
            from huggingface_hub import HfApi

            api = HfApi()
            for repo_id, folder in repos.items():
                api.create_repo(repo_id, repo_type="dataset")
                api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="dataset")
        imagenet = server.get_repo("ILSVRC/imagenet-1k", "dataset")
        imagenet.gated, imagenet.gated_users = "manual", {"granted"}
        yield server


def _run(hub: LoopbackHub, tmp_path: Path, script: str, token: str | None = None) -> dict:
    env = hub.client_env(hf_home=tmp_path / "hf", token=token)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


_SUMMARY = """
import hashlib, json
import numpy as np
import datasets
from hf_gsc.data import load_benchmark

def digest(image):
    return hashlib.sha256(np.asarray(image.convert("RGB")).tobytes()).hexdigest()[:16]

def rows(dataset):
    return [[digest(item["image"]), int(item["label"])] for item in dataset]

def summary(name, streaming):
    bench = load_benchmark(name, streaming=streaming)
    return {
        "types": sorted({type(d).__name__ for d in [*bench.id_splits.values(), *bench.ood_splits.values()]}),
        "columns": sorted({tuple(d.column_names) for d in [*bench.id_splits.values(), *bench.ood_splits.values()]}),
        "num_labels": bench.num_labels, "label_names": list(bench.label_names[:3]),
        "id": {split: rows(bench.id_splits[split]) for split in ("train", "validation", "test")},
        "ood": {split: rows(d) for split, d in bench.ood_splits.items()},
    }
"""


def _hub_rows(hub: LoopbackHub, repo_id: str, split_file: str, image: str, label: str | None) -> list[list]:
    """(sha256 prefix of the pixels, label) of every row of one uploaded parquet file, read back from the server."""
    data = hub.read_file(repo_id, split_file, repo_type="dataset")
    out = []
    for row in pq.read_table(io.BytesIO(data)).to_pylist():
        pixels = np.asarray(Image.open(io.BytesIO(row[image]["bytes"])).convert("RGB")).tobytes()
        out.append([hashlib.sha256(pixels).hexdigest()[:16], row[label] if label else -1])
    return out


def _zip_rows(hub: LoopbackHub, repo_id: str, archive: str) -> dict[str, list]:
    """Member path -> (sha256 prefix of the pixels, -1) of every image in an uploaded archive."""
    with zipfile.ZipFile(io.BytesIO(hub.read_file(repo_id, archive, repo_type="dataset"))) as opened:
        return {name: [hashlib.sha256(np.asarray(Image.open(io.BytesIO(opened.read(name))).convert("RGB"))
                                      .tobytes()).hexdigest()[:16], -1] for name in opened.namelist()}


def test_cifar_benchmarks_by_name_downloaded_and_streamed(hub, tmp_path):
    out = _run(hub, tmp_path, _SUMMARY + """
from datasets.distributed import split_dataset_by_node
streamed = load_benchmark("cifar10-ood", ood_splits=["svhn"], streaming=True)
by_node = {split: [rows(split_dataset_by_node(d, rank, 2)) for rank in (0, 1)]
           for split, d in [("validation", streamed.id_splits["validation"]), ("svhn", streamed.ood_splits["svhn"])]}
print(json.dumps({"cifar10": summary("cifar10-ood", False), "cifar10_streamed": summary("cifar10-ood", True),
                  "cifar100": summary("cifar100-ood", False), "by_node": by_node}))
""")
    cifar10, streamed, cifar100 = out["cifar10"], out["cifar10_streamed"], out["cifar100"]
    assert cifar10["types"] == ["Dataset"] and streamed["types"] == ["IterableDataset"]
    assert cifar10["columns"] == streamed["columns"] == [["image", "label"]]
    assert cifar10["num_labels"] == 10 and cifar10["label_names"] == CIFAR10_NAMES[:3]
    assert cifar100["num_labels"] == 100 and cifar100["label_names"] == ["fine0", "fine1", "fine2"]

    # ID: test is the Hub test split; train and validation partition the Hub train split, disjointly.
    train = _hub_rows(hub, "uoft-cs/cifar10", "data/train-00000-of-00001.parquet", "img", "label")
    test = _hub_rows(hub, "uoft-cs/cifar10", "data/test-00000-of-00001.parquet", "img", "label")
    assert cifar10["id"]["test"] == test
    validation, rest = cifar10["id"]["validation"], cifar10["id"]["train"]
    assert 0 < len(validation) < len(train) / 2
    assert sorted(map(tuple, validation + rest)) == sorted(map(tuple, train))
    assert not {tuple(r) for r in validation} & {tuple(r) for r in rest}
    fine = _hub_rows(hub, "uoft-cs/cifar100", "data/test-00000-of-00001.parquet", "img", "fine_label")
    assert cifar100["id"]["test"] == fine

    # OOD: the configured split of each repo, every label -1; textures joins DTD's train and test.
    svhn = _hub_rows(hub, "ufldl-stanford/svhn", "cropped_digits/parts/test-00000-of-00001.parquet", "image", None)
    assert cifar10["ood"]["svhn"] == svhn
    dtd = [_hub_rows(hub, "tanganke/dtd", f"data/{s}-00000-of-00001.parquet", "image", None) for s in ("train", "test")]
    assert cifar10["ood"]["textures"] == dtd[0] + dtd[1]
    assert {name: len(rows) for name, rows in cifar10["ood"].items()} == {
        "cifar100": 6, "tin": 3, "mnist": 5, "svhn": 4, "textures": 5, "places365": 2,
        "lsun_crop": 4, "lsun_resize": 3, "isun": 2}
    # Near-OOD: the other CIFAR's test split (labels dropped) and OpenOOD's TinyImageNet subset.
    assert cifar10["ood"]["cifar100"] == [[digest, -1] for digest, _ in fine]
    assert cifar100["ood"]["cifar10"] == [[digest, -1] for digest, _ in test]
    assert {name: len(rows) for name, rows in cifar100["ood"].items()} == {
        "cifar10": 6, "tin": 2, "mnist": 5, "svhn": 4, "textures": 5, "places365": 1,
        "lsun_crop": 4, "lsun_resize": 3, "isun": 2}
    mnist = [_hub_rows(hub, "ylecun/mnist", f"mnist/{s}-00000-of-00001.parquet", "image", None) for s in ("train", "test")]
    assert cifar10["ood"]["mnist"] == mnist[0] + mnist[1]
    # The OpenOOD archive sets keep exactly the listed images (the archive holds others).
    tin = _zip_rows(hub, "torch-uncertainty/tiny-imagenet-200", "tin.zip")
    assert sorted(cifar10["ood"]["tin"]) == sorted(tin[p] for p in OPENOOD_LISTS["cifar10/test_tin.txt"])
    assert sorted(cifar100["ood"]["tin"]) == sorted(tin[p] for p in OPENOOD_LISTS["cifar100/test_tin.txt"])
    places = _zip_rows(hub, "torch-uncertainty/Places365", "places365.zip")
    assert sorted(cifar10["ood"]["places365"]) == sorted(places[p] for p in OPENOOD_LISTS["cifar10/test_places365.txt"])
    for name in ("svhn", "textures", "mnist", "lsun_crop"):
        assert cifar100["ood"][name] == cifar10["ood"][name]

    # Streaming gives the same rows in the same order, and the same hold-out; split over two processes
    # (datasets.distributed.split_dataset_by_node), the streams cover each split once.
    assert streamed["id"] == cifar10["id"] and streamed["ood"] == cifar10["ood"]
    for split, whole in (("validation", cifar10["id"]["validation"]), ("svhn", cifar10["ood"]["svhn"])):
        rank0, rank1 = out["by_node"][split]
        assert rank0 and rank1 and sorted(map(tuple, rank0 + rank1)) == sorted(map(tuple, whole))
    assert not hub.unhandled_requests()


def test_imagenet_ood_is_gated_and_says_how_to_authenticate(hub, tmp_path):
    script = """
import json
from hf_gsc.data import load_benchmark
from hf_gsc.data.splits import GatedDatasetError
try:
    load_benchmark("imagenet-ood")
except GatedDatasetError as error:
    print(json.dumps({"error": str(error)}))
"""
    for token in (None, "hf_stranger"):
        message = _run(hub, tmp_path / str(token), script, token=token)["error"]
        assert "\n" not in message
        assert message.startswith("the Hub dataset 'ILSVRC/imagenet-1k' is gated and refused access: accept its terms on "
                                  "https://huggingface.co/datasets/ILSVRC/imagenet-1k")
        assert "`huggingface-cli login`" in message and "HF_TOKEN" in message

    out = _run(hub, tmp_path / "granted", _SUMMARY + 'print(json.dumps(summary("imagenet-ood", True)))',
               token="hf_granted")
    assert out["types"] == ["IterableDataset"] and out["num_labels"] == 1000
    validation = _hub_rows(hub, "ILSVRC/imagenet-1k", "data/validation-00000-of-00001.parquet", "image", "label")
    assert out["id"]["test"] == validation  # the paper's ID test set is ImageNet's validation split
    assert len(out["id"]["train"]) + len(out["id"]["validation"]) == SIZES["train"]
    assert {name: len(rows) for name, rows in out["ood"].items()} == {
        "ssb_hard": 2, "ninco": 3, "inaturalist": 3, "textures": 5, "openimage_o": 2}
    for name, repo_id, archive in (("ssb_hard", "torch-uncertainty/SSB_hard", "ssb_hard.zip"),
                                   ("ninco", "torch-uncertainty/Ninco", "ninco.zip")):
        rows = _zip_rows(hub, repo_id, archive)
        assert sorted(out["ood"][name]) == sorted(rows[p] for p in OPENOOD_LISTS[f"imagenet1k/test_{name}.txt"])
    openimage = _zip_rows(hub, "torch-uncertainty/Openimage-O", "openimage_o.zip")
    assert sorted(out["ood"]["openimage_o"]) == sorted(openimage[f"openimage_o/{p}"]
                                                       for p in OPENOOD_LISTS["imagenet1k/test_openimage_o.txt"])
    assert {label for rows in out["ood"].values() for _, label in rows} == {-1}


def test_imagenet_from_a_script_repo_says_what_to_do_and_reads_a_copy_named_by_the_environment(hub, tmp_path):
    """A Hub repo that is a loading script (as ``ILSVRC/imagenet-1k`` is reported to be) is refused by ``datasets``
    4; the error names what to do, and ``HF_GSC_IMAGENET`` then points the benchmark at a copy of data files."""
    script_repo = tmp_path / "script_repo"
    script_repo.mkdir()
    (script_repo / "imagenet-script.py").write_text("import datasets\n")
    (script_repo / "README.md").write_text("---\nlicense: other\n---\n")
    with hub.patch_client(token="hf_owner"):
        from huggingface_hub import HfApi

        HfApi().create_repo("owner/imagenet-script", repo_type="dataset")
        HfApi().upload_folder(folder_path=str(script_repo), repo_id="owner/imagenet-script", repo_type="dataset")
    script = """
import json, os
from hf_gsc.data import load_benchmark
from hf_gsc.data.splits import ScriptDatasetError
try:
    load_benchmark("imagenet-ood", ood_splits=[])
except ScriptDatasetError as error:
    print(json.dumps({"error": str(error)}))
"""
    hub_env = hub.client_env(hf_home=tmp_path / "hf")
    env = {**hub_env, "HF_GSC_IMAGENET": "owner/imagenet-script"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                            timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    message = json.loads(result.stdout.strip().splitlines()[-1])["error"]
    assert "\n" not in message
    assert message.startswith("the Hub dataset 'owner/imagenet-script' is stored as a loading script")
    assert "point HF_GSC_IMAGENET at it" in message and "'label' as a ClassLabel" in message

    # A local folder of parquet files with the ImageNet layout, named by HF_GSC_IMAGENET, is read instead.
    local = tmp_path / "imagenet_copy"
    _classified(local, {"train": SIZES["train"], "validation": SIZES["validation"]}, "image",
                {"label": datasets.ClassLabel(names=[f"n{i:08d}" for i in range(1000)])}, seed=90)
    env = {**hub_env, "HF_GSC_IMAGENET": str(local / "data")}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(_SUMMARY + """
bench = load_benchmark("imagenet-ood", ood_splits=[])
print(json.dumps({"num_labels": bench.num_labels, "test": rows(bench.id_splits["test"])}))
""")], env=env, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr[-4000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    expected = datasets.Dataset.from_parquet(str(local / "data" / "validation-00000-of-00001.parquet"))
    assert out["num_labels"] == 1000 and [label for _, label in out["test"]] == expected["label"]
