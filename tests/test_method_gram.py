"""Gram against OpenOOD's ``gram_postprocessor.py`` as the Gram paper's first author rewrote it (``FeatureExtractor``,
``G_p``, ``delta``, ``sample_estimator``, ``get_deviations``), with ``configs/postprocessors/gram.yml``, written again
in torch on the tiny models. The one change: the held-out tenth of each class is every tenth sample in the order of
the data, where OpenOOD draws it with ``random.sample`` (unseeded)."""

from __future__ import annotations

import copy
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import IMAGE_SIZE, NUM_LABELS, make_tiny_model
from torch import nn

from hf_gsc import AutoOODDetector
from hf_gsc.detectors import DETECTORS, get_detector
from hf_gsc.detectors.gram import GramRanges


#: float64 on both sides; the Gram row sums are added in another order here (``X (X^T 1)``, not ``(X X^T) 1``).
RTOL = 1e-10


class FeatureExtractor:
    """OpenOOD's ``FeatureExtractor``: a forward hook on every ``nn.ReLU`` and ``nn.Conv2d`` of the model, appending
    each output in the order of the forward."""

    def __init__(self, model):
        self.model, self.feat_list = model, []
        layers = [m for m in model.modules() if isinstance(m, (nn.ReLU, nn.Conv2d))]
        self.handles = [layer.register_forward_hook(lambda _, __, output: self.feat_list.append(output))
                        for layer in layers]

    def __call__(self, data):
        logits = self.model(pixel_values=data).logits
        features, self.feat_list = self.feat_list, []
        return logits, features

    def destroy_hooks(self):
        for handle in self.handles:
            handle.remove()


class HiddenStates:
    """The ``blocks`` layer set: OpenOOD's earlier ``model(data, return_feature_list=True)``, a ResNet's stem output
    then each stage's, which are a transformers model's ``hidden_states`` (a ViT's tokens ``(B, T, D)`` as they are)."""

    def __init__(self, model):
        self.model = model

    def __call__(self, data):
        output = self.model(pixel_values=data, output_hidden_states=True)
        return output.logits, list(output.hidden_states)

    def destroy_hooks(self):
        pass


def G_p(ob, p):  # noqa: N802  (OpenOOD's name)
    temp = ob.detach()
    temp = temp ** p
    temp = temp.reshape(temp.shape[0], temp.shape[1], -1)
    temp = (torch.matmul(temp, temp.transpose(dim0=2, dim1=1))).sum(dim=2)
    return (temp.sign() * torch.abs(temp) ** (1 / p)).reshape(temp.shape[0], -1)


def delta(mins, maxs, x):
    dev = (F.relu(mins - x) / torch.abs(mins + 10 ** -6)).sum(dim=1, keepdim=True)
    dev += (F.relu(x - maxs) / torch.abs(maxs + 10 ** -6)).sum(dim=1, keepdim=True)
    return dev


def every_tenth(count):
    """The held-out positions of a class of ``count`` samples: ``int(0.1 * count)`` of them, as OpenOOD's
    ``random.sample(range(L), int(0.1 * L))``, but every tenth instead of drawn."""
    held = list(range(9, count, 10))
    assert len(held) == int(0.1 * count)
    return held


@torch.no_grad()
def sample_estimator(model, batches, num_classes, powers):
    gram_features = defaultdict(lambda: defaultdict(lambda: defaultdict(lambda: None)))
    mins, maxs = {}, {}
    class_counts = Counter()
    for data, label in batches:
        _, feature_list = model(data)
        class_counts.update(Counter(label.cpu().numpy()))
        for layer_idx, feature in enumerate(feature_list):
            for power in powers:
                gram_feature = G_p(feature, power).cpu()
                for class_ in range(num_classes):
                    if gram_features[layer_idx][power][class_] is None:
                        gram_features[layer_idx][power][class_] = gram_feature[label == class_]
                    else:
                        gram_features[layer_idx][power][class_] = torch.cat(
                            [gram_features[layer_idx][power][class_], gram_feature[label == class_]], dim=0)
    val_idxs, train_idxs = {}, {}
    for c in class_counts:
        count = class_counts[c]
        val_idxs[c] = every_tenth(count)
        train_idxs[c] = sorted(set(range(count)) - set(val_idxs[c]))
    normalize_factors = []
    for layer_idx in gram_features:
        total_delta = None
        for class_ in class_counts:
            trn, val = train_idxs[class_], val_idxs[class_]
            class_deltas = 0
            for power in powers:
                mins[layer_idx, power, class_] = gram_features[layer_idx][power][class_][trn].min(dim=0, keepdim=True)[0]
                maxs[layer_idx, power, class_] = gram_features[layer_idx][power][class_][trn].max(dim=0, keepdim=True)[0]
                class_deltas += delta(mins[layer_idx, power, class_], maxs[layer_idx, power, class_],
                                      gram_features[layer_idx][power][class_][val])
            total_delta = class_deltas if total_delta is None else torch.cat([total_delta, class_deltas], dim=0)
        normalize_factors.append(total_delta.mean(dim=0, keepdim=True))
    return mins, maxs, torch.cat(normalize_factors, dim=1)


@torch.no_grad()
def get_deviations(model, data, mins, maxs, normalize_factors, powers):
    deviations = torch.zeros(data.shape[0], 1, dtype=torch.float64)
    logits, feature_list = model(data)
    confs, preds = F.softmax(logits, dim=1).cpu().detach().max(dim=1)
    for layer_idx, feature in enumerate(feature_list):
        n = normalize_factors[:, layer_idx].item()
        for power in powers:
            gram_feature = G_p(feature, power).cpu()
            for class_ in range(logits.shape[1]):
                deviations[preds == class_] += delta(mins[layer_idx, power, class_], maxs[layer_idx, power, class_],
                                                     gram_feature[preds == class_]) / n
    return preds, -deviations / confs[:, None]


def openood_gram(model, fit_batches, data, powers, layer_set):
    net = (FeatureExtractor if layer_set == "conv_relu" else HiddenStates)(model)
    mins, maxs, normalize_factors = sample_estimator(net, fit_batches, NUM_LABELS, powers)
    _, scores = get_deviations(net, data, mins, maxs, normalize_factors, powers)
    net.destroy_hooks()
    return scores[:, 0].numpy(), normalize_factors


def fit_batches(count=300, seed=5):
    generator = torch.Generator().manual_seed(seed)
    # Two scales, so that the held-out samples leave the ranges of every layer (a normaliser of 0 is refused).
    x = torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator, dtype=torch.float64)
    x = x * torch.rand(count, 1, 1, 1, generator=generator, dtype=torch.float64).mul(1.5).add(0.25)
    y = torch.randint(0, NUM_LABELS, (count,), generator=generator)
    return [(x[i:i + 64], y[i:i + 64]) for i in range(0, count, 64)]


def scored_inputs():
    return 1.5 * torch.randn(8, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(6),
                             dtype=torch.float64)


@pytest.mark.parametrize("arch", ["resnet", "vit"])
@pytest.mark.parametrize(("powers", "layer_set"), [((1, 2, 3, 4, 5), "conv_relu"), ((1, 3, 10), "conv_relu"),
                                                ((1, 2, 3, 4, 5), "blocks")])
def test_gram_matches_openood(arch, powers, layer_set):
    model, batches, inputs = make_tiny_model(arch), fit_batches(), scored_inputs()
    expected, normalize_factors = openood_gram(model, batches, inputs, powers, layer_set)
    assert (normalize_factors > 0).all()  # OpenOOD divides by them
    detector = get_detector("gram", model, powers=list(powers), layer_set=layer_set).fit(batches)
    # OpenOOD's layers are in the order of the forward, these in the order of the modules (a ResNet runs its shortcut
    # after the block's convolutions): the same normalisers, and the score sums over the layers.
    np.testing.assert_allclose(np.sort(detector.normalizers.numpy()), np.sort(normalize_factors[0].numpy()), rtol=RTOL)
    actual = detector.score(inputs).double().numpy()
    np.testing.assert_allclose(actual, expected, rtol=RTOL)
    assert np.ptp(expected) > 0.1 * np.abs(expected).max()  # the scores differ from input to input


def test_the_deviation_is_against_the_predicted_class_and_divided_by_the_msp():
    """A wrong class's ranges, or the deviation without the MSP, differ from OpenOOD's score (the test can fail)."""
    model, batches, inputs = make_tiny_model("resnet"), fit_batches(), scored_inputs()
    expected, _ = openood_gram(model, batches, inputs, (1, 2, 3, 4, 5), "conv_relu")
    detector = get_detector("gram", model).fit(batches)
    confidence = model(pixel_values=inputs).logits.softmax(dim=1).amax(dim=1).detach().numpy()
    assert np.abs(expected * confidence - expected).max() > 1e-3 * np.abs(expected).max()
    np.testing.assert_allclose(detector.score(inputs).numpy(), expected, rtol=RTOL)


def test_defaults_layers_and_refusals():
    assert DETECTORS["gram"].defaults == {"powers": (1, 2, 3, 4, 5), "layer_set": "conv_relu"}
    assert DETECTORS["gram"].one_pass and DETECTORS["gram"].fit_split == "train"
    resnet = make_tiny_model("resnet")
    paths = [split.module_path for split in get_detector("gram", resnet).layer_splits]
    assert paths == [name for name, m in resnet.named_modules() if isinstance(m, (nn.Conv2d, nn.ReLU))]
    vit = make_tiny_model("vit")  # GELUs: the patch embedding's convolution only
    assert [s.module_path for s in get_detector("gram", vit).layer_splits] == [
        "vit.embeddings.patch_embeddings.projection"]
    with pytest.raises(ValueError, match=r"powers must be a non-empty list of distinct positive integers"):
        get_detector("gram", resnet, powers=[1, 1])
    with pytest.raises(ValueError, match=r"layer_set"):
        get_detector("gram", resnet, layer_set="every")

    class Dense(nn.Module):  # no nn.Conv2d, no nn.ReLU
        def __init__(self):
            super().__init__()
            self.classifier = nn.Linear(IMAGE_SIZE * IMAGE_SIZE * 3, NUM_LABELS)

        def forward(self, pixel_values):
            from transformers.modeling_outputs import ImageClassifierOutput

            return ImageClassifierOutput(logits=self.classifier(torch.tanh(pixel_values.flatten(1))))

    with pytest.raises(ValueError, match=r"reads the outputs of the nn.Conv2d and nn.ReLU modules, and Dense has none"):
        get_detector("gram", Dense().double())


def test_a_fit_needs_every_class_and_a_held_out_sample():
    model = make_tiny_model("resnet")
    x = torch.randn(12, 3, IMAGE_SIZE, IMAGE_SIZE, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"classes \[4\] have none"):
        get_detector("gram", model).fit([(x, torch.arange(12) % 4)])
    with pytest.raises(ValueError, match=r"no class has 10 samples"):
        get_detector("gram", model).fit([(x[:10], torch.arange(10) % NUM_LABELS)])


def test_ranges_and_held_out_deviations_gathered_over_processes():
    """Two processes' ranges and held-out values combine through ``FitShards`` (a minimum is not a sum); the held-out
    values kept (those outside the range so far) give the deviation sums of every held-out value."""
    generator = torch.Generator().manual_seed(0)
    values = [torch.randn(30, 4, generator=generator, dtype=torch.float64) for _ in range(4)]
    labels = [torch.arange(30) % 3 for _ in range(4)]
    parts = [GramRanges(3), GramRanges(3)]
    for index, (v, y) in enumerate(zip(values, labels)):
        parts[index % 2].update(v, y, [2, 2])

    class Recorder:  # the second process's side of each collective
        num_processes = 2

        def __init__(self):
            self.seen = []

        def batches(self, local):
            self.seen.append(list(local))
            return list(local)

        def sum(self, local):
            self.seen.append(local)
            return local

    class TwoProcesses:  # the first process's: both processes' batches, interleaved as in the data
        num_processes = 2

        def __init__(self, other):
            self.other, self.calls = other, 0

        def batches(self, local):
            other = self.other[self.calls]
            self.calls += 1
            return [t for pair in zip(local, other) for t in pair]

        def sum(self, local):
            other = self.other[self.calls]
            self.calls += 1
            return local + other

    recorder = Recorder()
    copy.deepcopy(parts[1]).gather(recorder)
    parts[0].gather(TwoProcesses(recorder.seen))
    # Each process's share holds 20 of each class (two batches of 10): its 10th and 20th are held out.
    held = torch.zeros(60, dtype=torch.bool)
    held[27:30] = held[57:60] = True
    share = [torch.cat(values[i::2]) for i in range(2)]
    share_labels = torch.cat(labels[:2])
    kept = torch.cat([s[~held] for s in share])
    kept_labels = torch.cat([share_labels[~held]] * 2)
    held_out = torch.cat([s[held] for s in share])
    held_labels = torch.cat([share_labels[held]] * 2)
    assert parts[0].count == 120 and parts[0].held_out_count == 12 and parts[0].channels == [2, 2]
    for c in range(3):
        assert torch.equal(parts[0].mins[c], kept[kept_labels == c].amin(dim=0))
        assert torch.equal(parts[0].maxs[c], kept[kept_labels == c].amax(dim=0))
    deviations = (F.relu(parts[0].mins[held_labels] - held_out) / torch.abs(parts[0].mins[held_labels] + 1e-6)
                  + F.relu(held_out - parts[0].maxs[held_labels]) / torch.abs(parts[0].maxs[held_labels] + 1e-6))
    expected = torch.stack([deviations[:, :2].sum(), deviations[:, 2:].sum()])
    assert expected.min() > 0  # held-out values do leave the ranges
    torch.testing.assert_close(parts[0].held_out_deviation_sums([2, 2]), expected, rtol=1e-12, atol=0)


def test_a_load_with_other_powers_than_the_fitted_ones_is_refused(tmp_path):
    model = make_tiny_model("resnet")
    detector = get_detector("gram", model).fit(fit_batches())
    detector.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"fitted at powers \[1, 2, 3, 4, 5\], not \[1, 2, 3, 4, 6\]"):
        AutoOODDetector.from_pretrained(tmp_path, model=model, powers=[1, 2, 3, 4, 6])
    with pytest.raises(ValueError, match=r"'fitted_powers' .* has shape \(5,\), expected \(2\)"):
        AutoOODDetector.from_pretrained(tmp_path, model=model, powers=[1, 2])
    loaded = AutoOODDetector.from_pretrained(tmp_path, model=model)
    np.testing.assert_array_equal(loaded.score(scored_inputs()).numpy(), detector.score(scored_inputs()).numpy())
