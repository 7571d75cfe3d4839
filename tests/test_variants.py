"""hf_gsc.analysis.variants: the beyond-the-paper comparison and its validation-only protocol,
on tiny random models and tiny generated data (no reference model, a few seconds)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc.analysis import variants as V
from hf_gsc.data.arrays import to_dataset
from hf_gsc.data.noise import generate_noise
from hf_gsc.data.preprocessing import decode_image


def tiny_transform(images: list) -> torch.Tensor:
    """28x28 grayscale benchmark images -> (B, 3, 16, 16) float64 pixel_values, like an image processor would."""
    images = np.stack([np.asarray(decode_image(v, "tiny", i).convert("L")) for i, v in enumerate(images)])
    pixels = torch.as_tensor(images, dtype=torch.float64)[:, None] / 127.5 - 1.0
    pixels = torch.nn.functional.interpolate(pixels, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear")
    return pixels.expand(-1, 3, -1, -1).contiguous()


def tiny_dataset(n: int, seed: int, labels: bool = True):
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    return to_dataset(images, rng.integers(0, 5, size=n) if labels else [-1] * n)


class NoTestSplits(Mapping):
    """ID splits that raise on any access to the test split, and record what was read."""

    def __init__(self, splits: dict):
        self._splits, self.read = splits, set()

    def __getitem__(self, key):
        if key == "test":
            raise AssertionError("the selection protocol read the ID test split")
        self.read.add(key)
        return self._splits[key]

    def __iter__(self):
        return iter(k for k in self._splits if k != "test")

    def __len__(self):
        return len(self._splits) - ("test" in self._splits)

    def values(self):  # a bulk read would include test
        raise AssertionError("the selection protocol iterated over all ID splits")

    items = values


@pytest.fixture(scope="module")
def vit_protocol():
    model = make_tiny_model("vit")
    detectors, unavailable = V.build_variants(model)
    splits = NoTestSplits({"train": tiny_dataset(24, 0), "validation": tiny_dataset(24, 1), "test": tiny_dataset(8, 2)})
    seen = []

    def builder(benchmark, jigsaw_source, num_samples, seed):
        seen.append((benchmark, len(jigsaw_source), num_samples, seed))
        return V.build_validation_ood(benchmark, jigsaw_source, num_samples, seed)

    result = V.run_protocol(detectors, splits, "fmnist-ood", tiny_transform, max_samples=8, max_fit_samples=12,
                            batch_size=8, validation_ood_builder=builder)
    return model, detectors, unavailable, splits, seen, result


def test_protocol_reads_only_train_and_validation(vit_protocol):
    _, detectors, unavailable, splits, seen, result = vit_protocol
    assert unavailable == {}
    assert splits.read == {"train", "validation"}
    assert seen == [("fmnist-ood", 8, 8, V.VALIDATION_SEED)]
    assert result["num_samples"] == {"id_validation_fit": 8, "id_validation_select": 8, "val_noise": 8, "val_jigsaw": 8}
    assert result["fit"]["gsc_fisher"]["split"] == "train" and result["fit"]["gsc_fisher"]["num_samples"] == 12
    assert result["fit"]["gsc_adaptive"]["split"] == "validation" and 0 < result["fit"]["gsc_adaptive"]["gradient_mass"] <= 1
    assert set(result["validation"]) == set(V.VARIANT_NAMES)
    assert result["choice"] in V.GSC_VARIANTS
    assert result["choice"] == V.select_variant(result["validation"])
    for name in V.VARIANT_NAMES:
        for values in result["validation"][name].values():
            assert 0 <= values["fpr95"] <= 1 and 0 <= values["auroc"] <= 1
    assert detectors["gsc_multilayer"].config.earlier_split_point == "vit.layers.-2"


def test_test_evaluation_and_report(vit_protocol):
    _, detectors, _, _, _, protocol = vit_protocol
    test = V.evaluate_test(detectors, tiny_dataset(20, 3), {"a": tiny_dataset(15, 4, False), "b": tiny_dataset(9, 5, False)},
                           tiny_transform, max_samples=10, batch_size=8)
    assert test["num_samples"] == {"id_test": 10, "a": 10, "b": 9}
    energy = test["test"]["energy"]
    assert energy["average"]["fpr95"] == pytest.approx((energy["a"]["fpr95"] + energy["b"]["fpr95"]) / 2)
    result = {"arch": "vit", "benchmark": "fmnist-ood", "unavailable": {"gsc_multilayer": "why"}, **protocol, **test,
              "test_best": V.select_variant(test["test"]), "choice_beats_default_on_test": False}
    text = V.markdown_tables([result], {"swin on fmnist-openset": "no checkpoint"})
    assert "| vit | energy |" in text and "(picked)" in text and "`gsc_multilayer` on vit: n/a (why)" in text
    assert "swin on fmnist-openset: not evaluated (no checkpoint)" in text


def test_multilayer_is_na_on_swin_with_the_reason():
    detectors, unavailable = V.build_variants(make_tiny_model("swin"))
    assert set(detectors) == set(V.VARIANT_NAMES) - {"gsc_multilayer"}
    assert "earlier_split_point" in unavailable["gsc_multilayer"]


def test_earlier_block_is_the_one_before_the_last():
    assert V.earlier_block(make_tiny_model("resnet")) == "resnet.encoder.stages.-2"
    assert V.earlier_block(make_tiny_model("vit")) == "vit.layers.-2"


def test_selection_rule_auroc_then_fpr_then_default_first():
    def entry(fpr, auroc):
        return {"average": {"fpr95": fpr, "auroc": auroc}}

    assert V.select_variant({"gsc": entry(0.5, 0.9), "gsc_fisher": entry(0.4, 0.8)}) == "gsc"
    assert V.select_variant({"gsc": entry(0.5, 0.9), "gsc_fisher": entry(0.4, 0.9)}) == "gsc_fisher"
    assert V.select_variant({"gsc": entry(0.4, 0.8), "gsc_fisher": entry(0.4, 0.9)}) == "gsc_fisher"
    assert V.select_variant({"gsc_fisher": entry(0.4, 0.9), "gsc": entry(0.4, 0.9)}) == "gsc"
    # Energy is reported but never chosen as the GSC default.
    assert V.select_variant({"energy": entry(0.0, 1.0), "gsc": entry(0.4, 0.9)}) == "gsc"


def test_verdict_needs_a_strict_majority():
    def result(choice):
        return {"choice": choice, "validation": {n: {} for n in V.GSC_VARIANTS}}

    assert V.verdict([result("gsc_fisher"), result("gsc")])["default"] == "gsc"
    assert V.verdict([result("gsc_fisher"), result("gsc_fisher"), result("gsc")])["default"] == "gsc_fisher"
    assert V.verdict([])["default"] == "gsc"


def test_validation_parts_are_disjoint():
    parts = V.split_validation(50, {"fit": 20, "select": 20, "jigsaw": 20})
    assert [len(p) for p in parts.values()] == [16, 16, 16]
    rows = np.concatenate(list(parts.values()))
    assert len(set(rows.tolist())) == len(rows) and rows.max() < 50


def test_validation_noise_differs_from_the_test_noise():
    test_noise, _ = generate_noise(60, seed=0)
    sets = V.build_validation_ood("fmnist-ood", None, 60)
    assert list(sets) == ["val_noise"]
    validation = np.stack([np.asarray(decode_image(v, "v", i)) for i, v in enumerate(sets["val_noise"]["image"])])
    assert not {bytes(x) for x in validation} & {bytes(x) for x in test_noise}


def test_openset_validation_ood_is_heldout_classes_of_validation_not_test():
    from hf_gsc.data import fashion_mnist
    from hf_gsc.data.benchmarks import OPENSET_OOD_CLASSES

    sets = V.build_validation_ood("fmnist-openset", None, 300)
    assert list(sets) == ["val_heldout_classes"] and len(sets["val_heldout_classes"]) == 300
    images = {bytes(np.asarray(decode_image(v, "v", i))) for i, v in enumerate(sets["val_heldout_classes"]["image"])}
    arrays = fashion_mnist.load_arrays()
    held_out = arrays["validation"].images[np.isin(arrays["validation"].labels, OPENSET_OOD_CLASSES)]
    assert images <= {bytes(x) for x in held_out}
    assert not images & {bytes(x) for x in arrays["test"].images}
