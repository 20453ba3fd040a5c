"""The model-shaped forward beside reloads: its layer shapes, its per-layer hook, its FLOPs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.model_forward import (
    COMPUTE_LOADS,
    MODEL_FOR_KIND,
    SHAPES,
    LayerShape,
    ModelForward,
    scaled,
)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_layer_runs_after_its_hook_and_changes_the_activations(name):
    forward = ModelForward(
        scaled(SHAPES[name], 64),
        tokens=8,
        layers=3,
        device=torch.device("cpu"),
        dtype=torch.float32,
    )
    before = forward._x.clone()
    seen: list[int] = []
    assert forward.queue(None, count=7, before_layer=seen.append) is None  # no events off CUDA
    assert seen == [0, 1, 2, 0, 1, 2, 0]
    assert forward._x.isfinite().all() and not torch.equal(forward._x, before)


def test_full_size_flops_match_the_models_projections():
    llama = ModelForward.__new__(ModelForward)
    llama.shape, llama.tokens = SHAPES["llama3-8b"], 4096
    # qkv, o, gate-up, down of Llama-3-8B: 218M weights a layer, two FLOPs a weight a token.
    weights = 4096 * 6144 + 4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096
    assert llama.flops_per_layer == 2 * 4096 * weights
    assert MODEL_FOR_KIND == {"mha": "llama3-8b", "mla": "deepseek-v3"}
    assert {load.tokens for load in COMPUTE_LOADS.values()} == {64, 256, 4096}


def test_a_shape_whose_projections_do_not_chain_is_refused():
    broken = LayerShape(hidden=8, attention=((8, 4), (16, 8)), mlp_inner=8)
    with pytest.raises(ValueError, match="wider"):
        ModelForward(broken, tokens=2, layers=1, device=torch.device("cpu"))
    no_return = LayerShape(hidden=8, attention=((8, 4),), mlp_inner=8)
    with pytest.raises(ValueError, match="must return 8"):
        ModelForward(no_return, tokens=2, layers=1, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="positive"):
        ModelForward(SHAPES["llama3-8b"], tokens=0, layers=1, device=torch.device("cpu"))
