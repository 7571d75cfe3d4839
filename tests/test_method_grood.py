"""GROOD (ID-only mode) against OpenOOD v1.5's ``grood.py`` (``update_prototype``, ``get_prototype_mean``,
``compute_ncc_loss`` and the autograd gradient of ``_compute_grad``), written again in torch on the tiny models'
public features; the nearest-gradient search exact (faiss's ``IndexFlatL2``, where OpenOOD's IVF index approximates
it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_detectors import setting  # noqa: F401  (tiny ViT and ResNet with fitting data)

from hf_gsc.detectors import DETECTORS


#: float64 on both sides; running means and autograd there, sums and the closed-form gradient here (measured: at
#: most 2.5e-15 relative on these models).
RTOL = 1e-10


def update_prototypes(features, target, num_classes):
    """``update_prototype`` over the batches: each class's running mean ``(sum + count proto) / (count + n)``."""
    prototypes = torch.zeros(num_classes, features[0].shape[1], dtype=torch.float64)
    counts = torch.zeros(num_classes, dtype=torch.long)
    for feats, labels in zip(features, target):
        for cl in labels.unique():
            masked = labels == cl
            n = masked.sum()
            prototypes[cl] = (feats[masked].sum(0) + counts[cl] * prototypes[cl]) / (counts[cl] + n)
            counts[cl] += n
    return prototypes


def ncc_gradients(feature, logits, prototypes, noise_proto, labels=None):
    """``compute_ncc_loss`` (cross-entropy of ``-||f - p_j||`` against the pseudo label) and ``_compute_grad``: the
    gradient of each kept sample's loss with respect to the noise prototype, one ``autograd.grad`` per sample."""
    noise_proto = noise_proto.clone().requires_grad_(True)
    prototypes = prototypes.clone().requires_grad_(True)
    pseudo_preds = logits.argmax(1)
    bsz = feature.shape[0]
    all_protos = torch.cat([prototypes, noise_proto.view(1, -1)], dim=0)
    vectors = (feature.reshape(bsz, 1, -1).detach() - all_protos).reshape(bsz, len(all_protos), -1)
    ncc_scores = -torch.norm(vectors, dim=2)
    loss = F.cross_entropy(ncc_scores, pseudo_preds, reduction="none")
    grads = []
    for i in range(bsz):
        if labels is not None and labels[i] != pseudo_preds[i]:
            continue
        grads.append(torch.autograd.grad(loss[i], [noise_proto, prototypes], retain_graph=True)[0].view(1, -1))
    return torch.cat(grads)


def openood_grood(setting, k):  # noqa: F811
    W, b = torch.from_numpy(setting.W), torch.from_numpy(setting.b)
    train = torch.from_numpy(setting.F_fit)
    labels = torch.from_numpy(setting.labels)
    batches = [(train[i:i + 16], labels[i:i + 16]) for i in range(0, len(train), 16)]
    prototypes = update_prototypes([f for f, _ in batches], [y for _, y in batches], W.shape[0])
    noise_proto = prototypes.clone().mean(0).view(-1)  # get_prototype_mean
    bank = torch.cat([ncc_gradients(f, f @ W.T + b, prototypes, noise_proto, y) for f, y in batches]).numpy()
    test = torch.from_numpy(setting.F_test)
    queries = ncc_gradients(test, test @ W.T + b, prototypes, noise_proto).numpy()
    squared = ((queries[:, None, :] - bank[None, :, :]) ** 2).sum(-1)  # IndexFlatL2: squared distances
    return -np.sort(squared, axis=1)[:, k - 1], bank


@pytest.mark.parametrize("k", [1, 5])
def test_grood_matches_openood_in_its_id_only_mode(setting, k):  # noqa: F811
    expected, bank = openood_grood(setting, k)
    detector = setting.detector("grood", k=k)
    np.testing.assert_allclose(detector.bank.numpy(), bank, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(detector.score(setting.x_test).double().numpy(), expected, rtol=RTOL)


def test_grood_defaults_and_grid():
    assert DETECTORS["grood"].defaults == {"k": 1}
    assert DETECTORS["grood"].search_space == {"k": (1, 10, 20, 50, 100)}
