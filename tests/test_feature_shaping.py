"""GSC's feature shaping: a GSC setting whose shapings are the shaping methods' own math (GSC + ASH is GSC with
``feature_shaping="ash_s"`` at the penultimate feature, not a copy of GSC's step)."""

from __future__ import annotations

import pytest
import torch
from conftest import IMAGE_SIZE, make_tiny_model

from hf_gsc import AutoOODDetector, GSCConfig
from hf_gsc.detectors.ash import ash_shape, default_ash_percentile
from hf_gsc.utils.feature_shapings import FEATURE_SHAPINGS


@pytest.fixture(scope="module")
def images():
    return torch.randn(6, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("arch", ["vit", "resnet"])
def test_gsc_ash_is_gsc_with_ash_s_shaping(arch, images):
    model = make_tiny_model(arch)
    gsc_ash = AutoOODDetector.from_pretrained(model, method="gsc_ash")
    gsc = AutoOODDetector.from_pretrained(model, method="gsc", split_point="penultimate", feature_shaping="ash_s")
    assert gsc.config.shaping_percentile == default_ash_percentile(model, "s") == gsc_ash.config.shaping_percentile
    torch.testing.assert_close(gsc.score(images), gsc_ash.score(images), rtol=0, atol=0)
    plain = AutoOODDetector.from_pretrained(model, method="gsc", split_point="penultimate")
    assert not torch.equal(plain.score(images), gsc.score(images))  # the shaping does something


def test_shaped_feature_is_ash_of_the_feature(images):
    model = make_tiny_model("resnet")
    gsc = AutoOODDetector.from_pretrained(model, method="gsc", split_point="penultimate", feature_shaping="ash_p",
                                          shaping_percentile=70.0)
    batch = gsc.backbone_pass(images)
    raw = gsc.backend.inner.features_of(batch)
    torch.testing.assert_close(gsc.backend.features_of(batch), ash_shape(raw.flatten(1), "p", 70.0).view(raw.shape))


def test_shaping_names_come_from_the_methods_and_bad_ones_fail_early():
    assert {"ash_p", "ash_b", "ash_s"} <= set(FEATURE_SHAPINGS)
    with pytest.raises(ValueError, match=r"GSCConfig\.feature_shaping must be 'none' or one of"):
        GSCConfig(feature_shaping="ash_x")
    with pytest.raises(ValueError, match="earlier_split_point"):
        AutoOODDetector.from_pretrained(make_tiny_model("vit"), method="gsc", feature_shaping="ash_s",
                                        earlier_split_point="vit.encoder.layer.0")


def test_the_shaping_names_live_on_the_ground_floor():
    """The names registry imports nothing from hf_gsc, and the methods that fill it and the config that reads it
    import it from there, not from a compute module."""
    import ast
    import inspect

    import hf_gsc.utils.feature_shapings as names
    from hf_gsc.detectors import ash, scale
    from hf_gsc.settings import config

    tree = ast.parse(inspect.getsource(names))
    imported = ["." * node.level + (node.module or "") for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [module for module in imported if module.startswith(("hf_gsc", "."))], imported
    for user in (ash, scale, config):
        source = inspect.getsource(user)
        assert "feature_shapings import" in source and "backends.shaped import" not in source, user.__name__


def test_assigning_a_shaping_rebuilds_the_detector(images, tmp_path):
    model = make_tiny_model("vit")
    gsc = AutoOODDetector.from_pretrained(model, method="gsc", split_point="penultimate")
    gsc.config.feature_shaping = "ash_s"
    fresh = AutoOODDetector.from_pretrained(model, method="gsc", split_point="penultimate", feature_shaping="ash_s")
    torch.testing.assert_close(gsc.score(images), fresh.score(images), rtol=0, atol=0)
    gsc.save_pretrained(tmp_path)
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=model)
    torch.testing.assert_close(loaded.score(images), fresh.score(images), rtol=0, atol=0)
