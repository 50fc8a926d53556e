"""Reference transformer: split equivalence, init, GQA, rotary embeddings, loss."""

from __future__ import annotations

import dataclasses
import math

import pytest

torch = pytest.importorskip("torch")

from pipeoffload.errors import ConfigError
from pipeoffload.training.model import Transformer, apply_rope, rope_angles
from pipeoffload.training.model_config import MODEL_PRESETS, ModelConfig, model_preset
from pipeoffload.training.split import (
    build_full_model,
    build_stage_modules,
    layers_per_stage,
    lm_loss,
    stage_layer_ranges,
    stage_param_names,
)

pytestmark = pytest.mark.torch

TINY = model_preset("tiny")
FIVE = dataclasses.replace(TINY, n_layers=5)


def tokens(batch: int = 2, seq: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seed))


def run_stages(stages: dict[int, torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    for s in sorted(stages):
        x = stages[s](x)
    return x


# ---- configuration --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_num_params_matches_the_built_model(name: str) -> None:
    config = model_preset(name)
    model = build_full_model(config, seed=0)
    assert config.num_params() == sum(p.numel() for p in model.parameters())


def test_presets_are_named_and_unknown_names_are_refused() -> None:
    assert model_preset("TINY") == MODEL_PRESETS["tiny"]
    assert model_preset("small").vocab_size == 256
    with pytest.raises(ConfigError, match="unknown model preset 'huge'.*tiny"):
        model_preset("huge")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"dim": 30}, "ModelConfig.dim 30 is not divisible by ModelConfig.n_heads 4"),
        ({"dim": 36, "n_heads": 4}, "head width ModelConfig.dim / ModelConfig.n_heads = 9 is odd"),
        ({"n_kv_heads": 3}, "not a multiple of ModelConfig.n_kv_heads 3"),
        ({"n_layers": 0}, "n_layers must be >= 1"),
        ({"norm_eps": 0.0}, "must be > 0"),
    ],
)
def test_invalid_model_configs_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(TINY, **changes)


# ---- splitting ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers", range(1, 10))
@pytest.mark.parametrize("num_stages", range(1, 6))
@pytest.mark.parametrize("lighter_ends", [False, True])
def test_layer_split_is_balanced_and_covers_every_layer(
    n_layers: int, num_stages: int, lighter_ends: bool
) -> None:
    # Balanced costs differ by at most one; with lighter_ends an end stage costs its layers
    # plus one, so every stage needs a cost of at least 2 once the ends are lighter.
    if lighter_ends:
        feasible = num_stages > 1 and n_layers + 2 >= 2 * num_stages
    else:
        feasible = n_layers >= num_stages
    if not feasible:
        with pytest.raises(ConfigError):
            layers_per_stage(n_layers, num_stages, lighter_ends=lighter_ends)
        return
    counts = layers_per_stage(n_layers, num_stages, lighter_ends=lighter_ends)
    assert sum(counts) == n_layers and min(counts) >= 1
    cost = list(counts)
    if lighter_ends:  # the embedding and the head each weigh as much as a layer
        cost[0] += 1
        cost[-1] += 1
    assert max(cost) - min(cost) <= 1
    ranges = stage_layer_ranges(n_layers, num_stages, lighter_ends=lighter_ends)
    assert [i for r in ranges for i in r] == list(range(n_layers))


def test_layer_split_errors_say_what_to_change() -> None:
    with pytest.raises(ConfigError, match="cannot split 3 layers into 4 stages"):
        layers_per_stage(3, 4)
    with pytest.raises(ConfigError, match=r"with lighter_ends: .*\[0, 2, 2, 0\].* or drop"):
        layers_per_stage(4, 4, lighter_ends=True)
    with pytest.raises(ConfigError, match="no effect with one stage"):
        layers_per_stage(4, 1, lighter_ends=True)
    with pytest.raises(ConfigError, match="cannot split"):
        build_stage_modules(TINY, 5, [0], seed=0)


def test_stage_indices_are_checked() -> None:
    with pytest.raises(ConfigError, match="stage index 3 is out of range for num_stages=3"):
        build_stage_modules(TINY, 3, [0, 3], seed=0)
    with pytest.raises(ConfigError, match="name a stage twice"):
        build_stage_modules(TINY, 3, [1, 1], seed=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("num_stages", "lighter_ends"),
                         [(1, False), (2, False), (3, False), (4, False), (5, False),
                          (2, True), (3, True)])
def test_stages_in_sequence_equal_the_full_model_bitwise(
    dtype: torch.dtype, num_stages: int, lighter_ends: bool
) -> None:
    full = build_full_model(FIVE, seed=3, dtype=dtype)
    stages = build_stage_modules(FIVE, num_stages, range(num_stages), seed=3, dtype=dtype,
                                 lighter_ends=lighter_ends)
    x = tokens()
    assert torch.equal(run_stages(stages, x), full(x))


def test_stage_shapes_follow_the_one_tensor_contract() -> None:
    stages = build_stage_modules(FIVE, 3, range(3), seed=0)
    x = tokens(batch=3, seq=7)
    h0 = stages[0](x)
    h1 = stages[1](h0)
    logits = stages[2](h1)
    assert h0.shape == h1.shape == (3, 7, FIVE.dim)
    assert logits.shape == (3, 7, FIVE.vocab_size)
    assert stages[0].has_embedding and not stages[0].has_head
    assert not stages[1].has_embedding and not stages[1].has_head
    assert stages[2].has_head and not stages[2].has_embedding


def test_stage_inputs_and_sequence_length_are_checked() -> None:
    stages = build_stage_modules(TINY, 2, range(2), seed=0)
    with pytest.raises(ConfigError, match="takes hidden states"):
        stages[1](tokens())
    with pytest.raises(ConfigError, match="takes token ids"):
        stages[0](torch.zeros(2, 4, TINY.dim))
    with pytest.raises(ConfigError, match="exceeds max_seq_len=32"):
        stages[0](tokens(seq=33))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("num_stages", [2, 3, 4])
def test_stagewise_backward_gives_the_full_models_gradients(
    dtype: torch.dtype, num_stages: int
) -> None:
    x, y = tokens(seed=1), tokens(seed=2)
    full = build_full_model(FIVE, seed=5, dtype=dtype)
    lm_loss(full(x), y).backward()

    stages = build_stage_modules(FIVE, num_stages, range(num_stages), seed=5, dtype=dtype)
    inputs, outputs, h = [], [], x
    for s in range(num_stages):  # cut the graph at every stage boundary, as a pipeline does
        h_in = h.detach().requires_grad_(h.is_floating_point())
        inputs.append(h_in)
        outputs.append(stages[s](h_in))
        h = outputs[-1]
    grad = None
    for s in reversed(range(num_stages)):
        if s == num_stages - 1:
            lm_loss(outputs[s], y).backward()
        else:
            outputs[s].backward(grad)
        grad = inputs[s].grad

    full_params = dict(full.named_parameters())
    seen = set()
    for module in stages.values():
        for local, global_name in stage_param_names(module).items():
            param = dict(module.named_parameters())[local]
            assert torch.equal(param.grad, full_params[global_name].grad), global_name
            seen.add(global_name)
    assert seen == set(full_params)


def test_stage_state_dicts_partition_the_full_state_dict() -> None:
    full = build_full_model(FIVE, seed=9).state_dict()
    stages = build_stage_modules(FIVE, 3, [2, 0, 1], seed=9, lighter_ends=True)
    assert sorted(stages) == [0, 1, 2]
    union: dict[str, torch.Tensor] = {}
    for module in stages.values():
        names = stage_param_names(module)
        for name, value in module.state_dict().items():
            assert names[name] not in union
            union[names[name]] = value
    assert union.keys() == full.keys()
    assert all(torch.equal(union[k], full[k]) for k in full)


def test_stage_param_names_rejects_foreign_modules() -> None:
    with pytest.raises(ConfigError, match="built by build_stage_modules"):
        stage_param_names(torch.nn.Linear(2, 2))


# ---- initialisation -------------------------------------------------------------------------


def test_init_ignores_the_global_rng_and_leaves_it_alone() -> None:
    with torch.random.fork_rng():
        torch.manual_seed(1)
        state = torch.random.get_rng_state()
        a = build_full_model(TINY, seed=0).state_dict()
        assert torch.equal(state, torch.random.get_rng_state())
        torch.manual_seed(2)
        b = build_full_model(TINY, seed=0).state_dict()
    c = build_full_model(TINY, seed=1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_init_is_the_same_in_float64_and_layers_differ() -> None:
    f32 = build_full_model(TINY, seed=0).state_dict()
    f64 = build_full_model(TINY, seed=0, dtype=torch.float64).state_dict()
    assert all(f64[k].dtype == torch.float64 and torch.equal(f64[k].float(), f32[k]) for k in f32)
    assert not torch.equal(f32["layers.0.feed_forward.w1.weight"],
                           f32["layers.1.feed_forward.w1.weight"])
    wq = f32["layers.0.attention.wq.weight"]
    wo = f32["layers.0.attention.wo.weight"]
    assert wq.std().item() == pytest.approx(TINY.init_std, rel=0.1)
    assert wo.std().item() == pytest.approx(TINY.init_std / math.sqrt(2 * TINY.n_layers), rel=0.1)
    assert torch.equal(f32["norm.weight"], torch.ones(TINY.dim))


def test_fresh_model_predicts_nearly_uniformly() -> None:
    # Small init makes logits close to 0, so the loss should be close to log(vocab).
    model = build_full_model(TINY, seed=0)
    loss = lm_loss(model(tokens(batch=4, seq=32)), tokens(batch=4, seq=32, seed=7))
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)


# ---- attention, GQA and rotary embeddings -----------------------------------------------------


def test_gqa_projection_shapes() -> None:
    config = dataclasses.replace(TINY, n_heads=4, n_kv_heads=1)
    layer = build_full_model(config, seed=0).layers["0"].attention
    head_dim = config.dim // 4
    assert layer.wq.weight.shape == (config.dim, config.dim)
    assert layer.wk.weight.shape == (head_dim, config.dim)
    assert layer.wv.weight.shape == (head_dim, config.dim)
    assert layer.wo.weight.shape == (config.dim, config.dim)


def test_gqa_equals_multi_head_attention_with_shared_key_value_heads() -> None:
    gqa_config = TINY  # 4 query heads share 2 key/value heads
    mha_config = dataclasses.replace(TINY, n_kv_heads=TINY.n_heads)
    gqa = build_full_model(gqa_config, seed=0, dtype=torch.float64)
    mha = build_full_model(mha_config, seed=0, dtype=torch.float64)
    group, hd = TINY.n_heads // TINY.n_kv_heads, TINY.head_dim
    state = gqa.state_dict()
    for name, value in list(state.items()):
        if name.endswith(("wk.weight", "wv.weight")):  # query head j reads kv head j // group
            heads = value.view(TINY.n_kv_heads, hd, TINY.dim)
            state[name] = heads[[j // group for j in range(TINY.n_heads)]].reshape(-1, TINY.dim)
    mha.load_state_dict(state)
    x = tokens()
    torch.testing.assert_close(mha(x), gqa(x), rtol=1e-12, atol=1e-12)


def reference_attention(
    layer: torch.nn.Module, x: torch.Tensor, config: ModelConfig
) -> torch.Tensor:
    """Causal GQA attention written out: complex-number rotary, explicit mask and softmax."""
    batch, seq, _ = x.shape
    hd, group = config.head_dim, config.n_heads // config.n_kv_heads
    q = (x @ layer.wq.weight.T).view(batch, seq, config.n_heads, hd)
    k = (x @ layer.wk.weight.T).view(batch, seq, config.n_kv_heads, hd)
    v = (x @ layer.wv.weight.T).view(batch, seq, config.n_kv_heads, hd)
    freqs = config.rope_theta ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    rot = torch.polar(torch.ones(seq, hd // 2, dtype=torch.float64),
                      torch.arange(seq, dtype=torch.float64)[:, None] * freqs)[:, None, :]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2)) * rot
                                  ).flatten(-2)

    q, k = rotate(q), rotate(k)
    out = torch.empty(batch, seq, config.n_heads, hd, dtype=x.dtype)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    for h in range(config.n_heads):
        scores = torch.einsum("bid,bjd->bij", q[:, :, h], k[:, :, h // group]) / math.sqrt(hd)
        weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[:, :, h] = weights @ v[:, :, h // group]
    return out.reshape(batch, seq, -1) @ layer.wo.weight.T


def test_attention_matches_a_written_out_reference() -> None:
    model = build_full_model(TINY, seed=4, dtype=torch.float64)
    layer = model.layers["1"].attention
    x = torch.randn(2, 9, TINY.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    cos, sin = rope_angles(torch.arange(9), TINY.head_dim, TINY.rope_theta)
    torch.testing.assert_close(layer(x, cos, sin), reference_attention(layer, x, TINY),
                               rtol=1e-10, atol=1e-12)


def test_rope_scores_depend_only_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(16, dtype=torch.float64, generator=gen)
    k = torch.randn(16, dtype=torch.float64, generator=gen)

    def score(m: int, n: int) -> torch.Tensor:
        cos, sin = rope_angles(torch.tensor([m, n]), 16, 10000.0)
        rq = apply_rope(q[None], cos[:1], sin[:1])
        rk = apply_rope(k[None], cos[1:], sin[1:])
        return (rq * rk).sum()

    for m, n in [(5, 2), (7, 7), (3, 11)]:
        for shift in (1, 17, 1000):
            torch.testing.assert_close(score(m + shift, n + shift), score(m, n))
    assert not torch.allclose(score(5, 2), score(5, 3))  # and it does depend on m - n
    cos, sin = rope_angles(torch.arange(4), 16, 10000.0)
    x = torch.randn(4, 16, dtype=torch.float64, generator=gen)
    rotated = apply_rope(x, cos, sin)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))  # a rotation
    torch.testing.assert_close(rotated[0], x[0])  # position 0 is not moved


def test_model_is_causal() -> None:
    model = build_full_model(TINY, seed=0, dtype=torch.float64)
    x = tokens(batch=1, seq=10)
    changed = x.clone()
    changed[0, 6] = (changed[0, 6] + 1) % 256
    a, b = model(x), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


# ---- loss and learning ------------------------------------------------------------------------


def test_lm_loss_is_mean_negative_log_likelihood() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen)
    targets = torch.randint(0, 5, (2, 3), generator=gen)
    probs = logits.softmax(-1)
    expected = -sum(
        math.log(probs[b, t, targets[b, t]].item()) for b in range(2) for t in range(3)
    ) / 6
    assert lm_loss(logits, targets).item() == pytest.approx(expected, rel=1e-12)
    assert lm_loss(logits.to(torch.bfloat16), targets).dtype == torch.float32


def test_tiny_model_can_memorise_a_batch() -> None:
    model = build_full_model(dataclasses.replace(TINY, n_layers=2), seed=0)
    x = tokens(batch=2, seq=16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = None
    for _ in range(15):
        loss = lm_loss(model(x[:, :-1]), x[:, 1:])
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < first / 2


def test_transformer_rejects_layers_outside_the_model() -> None:
    with pytest.raises(ConfigError, match="layer 4 does not exist"):
        Transformer(TINY, [3, 4], embedding=False, head=False)
