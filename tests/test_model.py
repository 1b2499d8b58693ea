"""The model: masks against dense references, padding, sharing, reversible gradients and memory,
parameter counts, and cached decoding."""

import dataclasses
from unittest import mock

import pytest
import torch

from crowdtrain.measure import peak_memory_bytes
from crowdtrain.model import DalleTransformer, ModelConfig, generate_images, get_preset
from crowdtrain.model import attention
from crowdtrain.model.attention import Attention, choose_impl, pattern_mask
from crowdtrain.model.config import DEFAULT_TOP_K, DEFAULT_TOP_P, sampling_filters
from crowdtrain.model.info import build_meta_model, model_info
from crowdtrain.model.sampling import filter_logits, sample_next
from crowdtrain.model.token_shift import shift_tokens

PATTERNS = ["full", "axial_row", "axial_col", "conv_like"]
# Token shift and LayerScale, off and on: every path must stay exact with both.
OPTIONS = [pytest.param({}, id="plain"), pytest.param(dict(token_shift=True, layer_scale=True), id="shift+scale")]


def small_config(**overrides) -> ModelConfig:
    base = dict(width=32, depth=4, heads=2, head_dim=16, text_len=6, text_vocab_size=40, image_height=4,
                image_width=5, image_vocab_size=24, patterns=("axial_row", "axial_col", "full", "conv_like"),
                share_ids=(0, 1, 2, 3), conv_kernel=3)
    base.update(overrides)
    return ModelConfig(**base)


def random_batch(cfg: ModelConfig, batch: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    text = torch.randint(1, cfg.text_vocab_size, (batch, cfg.text_len), generator=g)
    # Different amounts of right padding per row, including a caption of a single token.
    for row, real in enumerate([cfg.text_len, 3, 1][:batch]):
        text[row, real:] = cfg.text_pad_id
    image = torch.randint(0, cfg.image_vocab_size, (batch, cfg.image_len), generator=g)
    return text, image


# ---- configuration -----------------------------------------------------------------------
def test_config_rejects_inconsistent_layers_with_a_clear_message():
    with pytest.raises(ValueError, match="one attention pattern per layer"):
        small_config(patterns=("full",))
    with pytest.raises(ValueError, match="sharing id 0 is given pattern"):
        small_config(share_ids=(0, 0, 1, 2))
    with pytest.raises(ValueError, match="unknown attention pattern"):
        small_config(patterns=("full", "full", "diagonal", "full"))
    with pytest.raises(ValueError, match="dropout must be 0"):
        small_config(reversible=True, dropout=0.1)
    with pytest.raises(ValueError, match="model.token_shift=False"):
        small_config(width=30, token_shift=True)


def test_config_round_trips_through_dict_and_fingerprint_tracks_architecture():
    cfg = get_preset("paper")
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    assert dataclasses.replace(cfg, checkpointing=True).fingerprint() == cfg.fingerprint()
    assert dataclasses.replace(cfg, width=512, head_dim=32).fingerprint() != cfg.fingerprint()
    assert cfg.token_shift and cfg.layer_scale, "the paper preset uses both"
    for option in ("token_shift", "layer_scale"):
        assert dataclasses.replace(cfg, **{option: False}).fingerprint() != cfg.fingerprint(), option
    with pytest.raises(ValueError, match="unknown model config key"):
        ModelConfig.from_dict({**cfg.to_dict(), "widht": 3})


# ---- masks -------------------------------------------------------------------------------
def test_dense_masks_follow_the_pattern_definitions():
    cfg = small_config(image_height=5, image_width=5, conv_kernel=3)
    keep = torch.tensor([[True, True, True, False, False, False]])
    t, w = cfg.text_len, cfg.image_width
    cell = lambda r, c: t + r * w + c
    allowed = {p: pattern_mask(p, cfg, keep)[0] for p in PATTERNS}
    q = cell(2, 3)
    for p, m in allowed.items():
        assert m[q, :3].all() and not m[q, 3:t].any(), "image queries see exactly the real text"
        assert not m[q, q + 1:].any(), "nothing after the query"
        assert m[q, q], "a query always sees itself"
    row = allowed["axial_row"][q, t:].view(5, 5)
    assert row.nonzero().tolist() == [[2, 0], [2, 1], [2, 2], [2, 3]]
    col = allowed["axial_col"][q, t:].view(5, 5)
    assert col.nonzero().tolist() == [[0, 3], [1, 3], [2, 3]]
    conv = allowed["conv_like"][q, t:].view(5, 5)
    assert conv.nonzero().tolist() == [[1, 2], [1, 3], [1, 4], [2, 2], [2, 3]]
    full = allowed["full"][q, t:]
    assert full.sum() == 2 * 5 + 4
    # Text queries: causal over real text, a padded query sees real text and itself only.
    text_rows = allowed["full"][:t, :t]
    assert text_rows[2].tolist() == [True, True, True, False, False, False]
    assert text_rows[4].tolist() == [True, True, True, False, True, False]
    assert not allowed["full"][:t, t:].any(), "text never sees the image"


@pytest.mark.parametrize("pattern", PATTERNS)
def test_efficient_attention_equals_dense_reference_forward_and_backward(pattern):
    torch.manual_seed(0)
    cfg = small_config(depth=2, patterns=(pattern, pattern), share_ids=(0, 1), image_height=5, image_width=4)
    model = DalleTransformer(cfg).double()
    text, image = random_batch(cfg)

    def run(impl):
        model.zero_grad()
        model.attention_impl = impl
        out = model(text, image, return_logits=True)
        out.loss.backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    dense, dense_grads = run("dense")
    fast, fast_grads = run("efficient")
    torch.testing.assert_close(fast.image_logits, dense.image_logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(fast.text_logits, dense.text_logits, rtol=1e-10, atol=1e-10)
    for name in dense_grads:
        torch.testing.assert_close(fast_grads[name], dense_grads[name], rtol=1e-9, atol=1e-11, msg=name)


def _efficient_vs_dense(model, text, image_in, prefix_rows=None):
    """Hidden states and all grads of run_layers under both implementations (float64)."""
    cfg = model.config
    results = {}
    for impl in ("dense", "efficient"):
        model.zero_grad()
        model.attention_impl = impl
        x = model.embed(text, image_in)
        if prefix_rows is not None:
            x = x[:, : cfg.text_len + prefix_rows * cfg.image_width]
        h = model.run_layers(x, model.text_keep(text))
        (h * torch.linspace(-1, 1, h.numel(), dtype=h.dtype).view_as(h)).sum().backward()
        results[impl] = h, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return results


def test_efficient_equals_dense_across_shapes_in_one_process():
    """The static block biases are cached per (pattern, grid, device, dtype): shapes that follow
    each other in one process (other grids, image prefixes of fewer rows, a wider conv window
    than the grid has rows) must each get their own and still match the dense reference."""
    torch.manual_seed(0)
    patterns = ("axial_row", "axial_col", "conv_like", "full")
    for height, width, kernel in [(5, 4, 3), (3, 6, 5), (6, 3, 5)]:
        cfg = small_config(image_height=height, image_width=width, conv_kernel=kernel, patterns=patterns)
        model = DalleTransformer(cfg).double()
        text, image = random_batch(cfg)
        image_in = model.image_stream(image)
        for rows in (height, 1, 2):
            out = _efficient_vs_dense(model, text, image_in, prefix_rows=rows)
            (h_dense, g_dense), (h_fast, g_fast) = out["dense"], out["efficient"]
            assert h_fast.shape[1] == cfg.text_len + rows * width
            torch.testing.assert_close(h_fast, h_dense, rtol=1e-10, atol=1e-10)
            assert g_fast.keys() == g_dense.keys()
            for name in g_dense:
                torch.testing.assert_close(g_fast[name], g_dense[name], rtol=1e-9, atol=1e-11, msg=name)


def test_a_prefix_of_whole_rows_gives_the_full_sequences_outputs():
    """Causality: the text plus the first rows, run alone, equal those positions of the full
    sequence (the uncached sampling baseline relies on this); other lengths are refused."""
    torch.manual_seed(0)
    cfg = small_config()
    model = DalleTransformer(cfg).double()
    text, image = random_batch(cfg)
    x = model.embed(text, model.image_stream(image))
    keep = model.text_keep(text)
    for impl in ("efficient", "dense"):
        model.attention_impl = impl
        full = model.run_layers(x, keep)
        n = cfg.text_len + 2 * cfg.image_width
        torch.testing.assert_close(model.run_layers(x[:, :n], keep), full[:, :n], rtol=1e-10, atol=1e-10)
    with pytest.raises(ValueError, match="whole image rows"):
        model.run_layers(x[:, : cfg.text_len + 3], keep)
    model.attention_impl = "sparse"
    with pytest.raises(ValueError, match="choose from"):
        model.run_layers(x, keep)


# ---- token shift ---------------------------------------------------------------------------
def test_token_shift_moves_the_documented_channels():
    cfg = small_config(width=8, text_len=4, image_height=3, image_width=3)
    t, w, n = cfg.text_len, cfg.image_width, cfg.seq_len
    keep = torch.tensor([[True, True, True, False]])  # the last text slot is padding
    x = (torch.arange(n, dtype=torch.float64)[:, None] + 1) * torch.ones(1, 8, dtype=torch.float64)
    x = x + torch.arange(8) / 10  # value = position + 1 + channel / 10
    out, past = shift_tokens(x[None], 0, cfg, keep)
    out = out[0]
    src = lambda pos, ch: 0.0 if pos is None else pos + 1 + ch / 10
    for pos in range(n):
        for ch in range(8):
            if pos < t:
                prev = pos - 1 if pos >= 1 and keep[0, pos - 1] else None
                want = src(prev, ch) if ch < 4 else src(pos, ch)
            else:
                r, c = divmod(pos - t, w)
                if ch < 2:
                    want = src(pos - w if r > 0 else None, ch)
                elif ch < 4:
                    want = src(pos - 1 if c > 0 else None, ch)
                else:
                    want = src(pos, ch)
            assert out[pos, ch].item() == pytest.approx(want), (pos, ch)
    assert torch.equal(past[0], x[-w:, :4]), "the past is the moving channels of the last image_width inputs"
    # The image-start cell reads nothing (first row and column), not the (padded) last text slot.
    assert (out[t, :4] == 0).all()


@pytest.mark.parametrize("reversible", [False, True])
@pytest.mark.parametrize("impl", ["dense", "efficient"])
def test_outputs_at_position_k_ignore_every_later_input_with_token_shift(reversible, impl):
    """Causality with the shift on: perturb the inputs at every position after k; the logits at
    positions 0..k must not move, for every k and all four patterns."""
    torch.manual_seed(0)
    cfg = small_config(token_shift=True, layer_scale=True, reversible=reversible)
    model = DalleTransformer(cfg).double().eval()
    model.attention_impl = impl
    text, image = random_batch(cfg, batch=2)
    keep = model.text_keep(text)
    x = model.embed(text, model.image_stream(image))

    def logits(inputs):
        h = model.final_norm(model.run_layers(inputs, keep))
        return torch.cat([model.logits(h, "text"), model.logits(h, "image")], dim=-1)

    with torch.no_grad():
        reference = logits(x)
        noise = torch.randn_like(x)
        for k in range(cfg.seq_len - 1):
            moved = x.clone()
            moved[:, k + 1:] += noise[:, k + 1:]
            out = logits(moved)
            torch.testing.assert_close(out[:, : k + 1], reference[:, : k + 1], rtol=1e-12, atol=1e-12,
                                       msg=f"position <= {k} saw a later input")
            assert not torch.allclose(out[:, k + 1], reference[:, k + 1]), "the perturbation reached position k+1"


# ---- LayerScale ----------------------------------------------------------------------------
def test_layer_scale_is_per_layer_even_when_modules_are_shared_and_starts_as_the_papers_code():
    cfg = small_config(depth=26, patterns=("axial_row", "axial_col") * 13, share_ids=(0, 1) * 13, layer_scale=True)
    model = DalleTransformer(cfg)
    assert model.layer_modules(0)[1] is model.layer_modules(2)[1], "attention shared"
    assert model.layers[0].attn_scale is not model.layers[2].attn_scale
    for i, own in enumerate(model.layers):
        want = 0.1 if i + 1 <= 18 else 1e-5 if i + 1 <= 24 else 1e-6
        for scale in (own.attn_scale, own.ff_scale):
            assert scale.shape == (cfg.width,) and torch.all(scale == torch.tensor(want)), (i, scale[0].item())
    plain = DalleTransformer(dataclasses.replace(cfg, layer_scale=False))
    extra = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in plain.parameters())
    assert extra == 2 * cfg.depth * cfg.width
    assert model_info(cfg)["unique_params"] - model_info(plain.config)["unique_params"] == extra


@pytest.mark.parametrize("reversible", [False, True])
def test_zero_layer_scales_make_every_layer_the_identity(reversible):
    """Both branches of every layer go through their layer's scale (training and decoding)."""
    torch.manual_seed(0)
    cfg = small_config(layer_scale=True, token_shift=True, reversible=reversible)
    model = DalleTransformer(cfg).double().eval()
    with torch.no_grad():
        for own in model.layers:
            own.attn_scale.zero_()
            own.ff_scale.zero_()
    text, image = random_batch(cfg)
    x = model.embed(text, model.image_stream(image))
    torch.testing.assert_close(model.run_layers(x, model.text_keep(text)), x, rtol=0, atol=0)
    state = model.new_decode_state(text)
    ids = torch.cat([text, model.image_stream(image)[:, :1]], dim=1)
    torch.testing.assert_close(model.decode_step(ids, 0, state), model.final_norm(x[:, : cfg.text_len + 1]))


def test_static_block_bias_cache_is_keyed_by_shape_device_and_dtype():
    build = attention._static_block_bias
    cpu = torch.device("cpu")
    a = build("conv_like", 4, 5, 3, cpu, torch.float32)
    assert build("conv_like", 4, 5, 3, cpu, torch.float32) is a, "same key, same tensor"
    assert a.shape == (4, 5, 2 * 5)
    assert build("conv_like", 3, 5, 3, cpu, torch.float32).shape == (3, 5, 10)
    assert build("conv_like", 4, 5, 3, cpu, torch.float64).dtype == torch.float64
    meta = build("conv_like", 4, 5, 3, torch.device("meta"), torch.float32)
    assert meta.device.type == "meta" and a.device.type == "cpu"
    assert build("axial_col", 4, 5, 3, cpu, torch.float32).shape == (1, 4, 4)
    assert build("axial_row", 4, 5, 3, cpu, torch.float32).shape == (1, 5, 5)
    # Query (1, 2) of a 3x3 conv window: key rows 0..1, columns 1..3, nothing after itself.
    allowed = torch.isfinite(a[1, 2]).view(2, 5)
    assert allowed.nonzero().tolist() == [[0, 1], [0, 2], [0, 3], [1, 1], [1, 2]]


def test_auto_picks_dense_for_short_sequences_and_full_and_efficient_for_long_ones():
    long_seq = attention.AUTO_EFFICIENT_MIN_SEQ
    assert choose_impl("auto", "axial_row", long_seq - 1) == "dense"
    assert choose_impl("auto", "axial_row", long_seq) == "efficient"
    assert choose_impl("auto", "conv_like", 4 * long_seq) == "efficient"
    assert choose_impl("auto", "full", 4 * long_seq) == "dense"
    assert choose_impl("efficient", "axial_row", 8) == "efficient"
    assert choose_impl("dense", "axial_col", 4 * long_seq) == "dense"
    # On CUDA the fused dense kernel wins at every length (measured on an H100); forcing stays.
    assert choose_impl("auto", "conv_like", 4 * long_seq, "cuda") == "dense"
    assert choose_impl("efficient", "conv_like", 4 * long_seq, "cuda") == "efficient"
    assert choose_impl("auto", "conv_like", 4 * long_seq, "cpu") == "efficient"
    with pytest.raises(ValueError, match="unknown attention implementation"):
        choose_impl("flash", "axial_row", 8)
    assert DalleTransformer(small_config()).attention_impl == "auto"

    # What auto says is what runs: the block path is entered only for long sequences.
    torch.manual_seed(0)
    side = 1 + int((long_seq - 6) ** 0.5)  # smallest square grid whose sequence is long
    cfg = small_config(image_height=side, image_width=side, patterns=("axial_row", "axial_col", "conv_like", "full"))
    assert cfg.seq_len >= long_seq > cfg.text_len + 2 * side
    model = DalleTransformer(cfg).double()
    text, image = random_batch(cfg, batch=2)
    x = model.embed(text, model.image_stream(image))
    keep = model.text_keep(text)
    with mock.patch.object(Attention, "_image_attention", autospec=True,
                           side_effect=Attention._image_attention) as blocks:
        auto = model.run_layers(x, keep)
        assert sorted(call.args[0].pattern for call in blocks.call_args_list) == ["axial_col", "axial_row", "conv_like"]
        blocks.reset_mock()
        model.run_layers(x[:, : cfg.text_len + 2 * side], keep)  # a short prefix: all dense
        assert blocks.call_count == 0
    model.attention_impl = "dense"
    torch.testing.assert_close(auto, model.run_layers(x, keep), rtol=1e-10, atol=1e-10)


def test_padding_is_neither_attended_to_nor_trained_on():
    torch.manual_seed(0)
    cfg = small_config()
    model = DalleTransformer(cfg).double()
    text, image = random_batch(cfg)
    out = model(text, image, return_logits=True)
    # Put garbage (non-pad ids) into the padded slots but keep them marked as padding via a
    # different pad id: the real positions' outputs must not move.
    cfg2 = dataclasses.replace(cfg, text_pad_id=cfg.text_vocab_size - 1)
    model2 = DalleTransformer(cfg2).double()
    model2.load_state_dict(model.state_dict())
    text2 = text.clone()
    text2[text == cfg.text_pad_id] = cfg2.text_pad_id
    out2 = model2(text2, image, return_logits=True)
    torch.testing.assert_close(out2.image_logits, out.image_logits)
    torch.testing.assert_close(out2.image_loss, out.image_loss)
    torch.testing.assert_close(out2.text_loss, out.text_loss)
    # Text loss counts only targets that are real tokens: row 2 (one real token) has none.
    only_short = model(text[2:], image[2:])
    assert only_short.text_loss.item() == 0.0
    w = cfg.image_loss_weight
    torch.testing.assert_close(out.loss, (out.text_loss + w * out.image_loss) / (1 + w))


def test_text_positions_predict_text_and_image_positions_predict_codes():
    cfg = small_config()
    model = DalleTransformer(cfg)
    text, image = random_batch(cfg)
    out = model(text, image, return_logits=True)
    assert out.text_logits.shape == (3, cfg.text_len - 1, cfg.text_vocab_size)
    assert out.image_logits.shape == (3, cfg.image_len, cfg.image_vocab_size)
    with pytest.raises(ValueError, match="text must be"):
        model(text[:, :-1], image)
    with pytest.raises(ValueError, match="image must be"):
        model(text, image[:, :-1])


# ---- sharing and parameter counts --------------------------------------------------------
def test_sharing_is_module_identity_and_norms_stay_per_layer():
    cfg = small_config(depth=6, patterns=("axial_row", "axial_col") * 3, share_ids=(0, 1) * 3)
    model = DalleTransformer(cfg)
    assert model.layer_modules(0)[1] is model.layer_modules(2)[1] is model.layer_modules(4)[1]
    assert model.layer_modules(1)[2] is model.layer_modules(5)[2]
    assert model.layer_modules(0)[1] is not model.layer_modules(1)[1]
    assert model.layer_modules(0)[0].attn_norm is not model.layer_modules(2)[0].attn_norm
    unshared = DalleTransformer(dataclasses.replace(cfg, share_ids=tuple(range(6))))
    info = model_info(cfg)
    assert info["unshared_params"] == sum(p.numel() for p in unshared.parameters())
    assert info["unique_params"] == sum(p.numel() for p in model.parameters())
    assert len(model.state_dict()) < len(unshared.state_dict())


def test_paper_preset_has_the_papers_parameter_counts_on_the_meta_device():
    cfg = get_preset("paper")
    assert cfg.width == 1024 and cfg.depth == 64 and cfg.heads == 16 and cfg.head_dim == 64
    assert cfg.patterns[:4] == ("axial_row", "axial_col", "axial_row", "axial_row") and cfg.patterns[-1] == "conv_like"
    model = build_meta_model(cfg)
    assert next(model.parameters()).device.type == "meta"
    info = model_info(cfg)
    assert abs(info["unique_params"] / 126e6 - 1) < 0.03, info["unique_params"]
    assert abs(info["unshared_params"] / 1.12e9 - 1) < 0.03, info["unshared_params"]
    assert 8 < info["sharing_ratio"] < 9.5


# ---- reversible and checkpointed stacks ----------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS)
def test_reversible_gradients_equal_plain_autograd_of_the_same_coupling(options):
    torch.manual_seed(0)
    cfg = small_config(reversible=True, **options)
    model = DalleTransformer(cfg).double()
    text, image = random_batch(cfg)

    def grads(recompute: bool):
        model.zero_grad()
        model.train(recompute)  # eval mode runs the coupling with plain autograd
        model(text, image).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    reference, recomputed = grads(False), grads(True)
    for name in reference:
        torch.testing.assert_close(recomputed[name], reference[name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("options", OPTIONS)
def test_checkpointing_gives_the_same_gradients(options):
    torch.manual_seed(0)
    cfg = small_config(**options)
    model = DalleTransformer(cfg).double()
    text, image = random_batch(cfg)
    model(text, image).loss.backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    ckpt = DalleTransformer(dataclasses.replace(cfg, checkpointing=True)).double()
    ckpt.load_state_dict(model.state_dict())
    ckpt(text, image).loss.backward()
    for name, p in ckpt.named_parameters():
        torch.testing.assert_close(p.grad, reference[name], msg=name)


def _step_peak(cfg: ModelConfig) -> int:
    torch.manual_seed(0)
    model = DalleTransformer(cfg)
    text, image = random_batch(cfg, batch=8)

    def step():
        model(text, image).loss.backward()
        model.zero_grad(set_to_none=True)

    return peak_memory_bytes(step, track=(model,))


def test_reversible_activation_memory_does_not_grow_with_depth():
    def cfg(depth, reversible):
        return small_config(width=64, depth=depth, patterns=("axial_row",) * depth, share_ids=(0,) * depth,
                            image_height=8, image_width=8, reversible=reversible)

    rev4, rev16 = _step_peak(cfg(4, True)), _step_peak(cfg(16, True))
    plain4, plain16 = _step_peak(cfg(4, False)), _step_peak(cfg(16, False))
    assert rev16 < rev4 * 1.1, (rev4, rev16)
    assert plain16 > plain4 * 2, (plain4, plain16)
    assert rev16 < plain16 / 3


# ---- decoding ----------------------------------------------------------------------------
@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("reversible", [False, True])
def test_cached_decoding_logits_equal_the_full_forward(reversible, options):
    """All four patterns (small_config has one layer of each); with token shift the cache also
    carries each branch's previous token and row above."""
    torch.manual_seed(0)
    cfg = small_config(reversible=reversible, rotary=True, **options)
    model = DalleTransformer(cfg).double()
    with torch.no_grad():  # norms and scales away from their initial values, so each one matters
        for own in model.layers:
            for p in own.parameters():
                p.add_(0.3 * torch.randn_like(p))
    text, _ = random_batch(cfg)
    codes, logits = generate_images(model, text, seed=3, top_k=None, return_logits=True)
    assert codes.shape == (3, cfg.image_height, cfg.image_width)
    model.eval()
    full = model(text, codes.flatten(1), return_logits=True)
    torch.testing.assert_close(logits, full.image_logits, rtol=1e-9, atol=1e-9)
    _, uncached = generate_images(model, text, seed=3, top_k=None, return_logits=True, use_cache=False)
    torch.testing.assert_close(uncached, logits, rtol=1e-9, atol=1e-9)


def test_decode_masks_are_built_once_per_step_and_pattern():
    cfg = small_config()
    model = DalleTransformer(cfg)
    text, _ = random_batch(cfg)
    state = model.new_decode_state(text)
    start = cfg.text_len + 3
    bias = state.mask("conv_like", start, 1, torch.float32)
    assert state.mask("conv_like", start, 1, torch.float32) is bias, "layers of one step share it"
    assert state.mask("conv_like", start + 1, 1, torch.float32) is not bias
    reference = pattern_mask("conv_like", cfg, model.text_keep(text), q_pos=torch.tensor([start]), num_keys=start + 1)
    assert torch.equal(torch.isfinite(bias)[:, 0], reference)
    assert torch.equal(state.mask("conv_like", start, 1)[:, 0], reference), "bool masks too"
    assert (bias[torch.isfinite(bias)] == 0).all()


@pytest.mark.parametrize("conv_kernel", [3, 5])
def test_decode_steps_read_exactly_the_keys_each_pattern_allows(conv_kernel):
    """A one-token step attends to the text plus a span of image cells; unmasked, those are
    exactly the keys the dense reference mask allows, for every cell of every pattern."""
    cfg = small_config(conv_kernel=conv_kernel)
    model = DalleTransformer(cfg)
    text, _ = random_batch(cfg)
    state = model.new_decode_state(text)
    keep = model.text_keep(text)
    t = cfg.text_len
    for pattern in ("axial_row", "axial_col", "full", "conv_like"):
        for cell in range(cfg.image_len):
            start = t + cell
            cells, mask = state.step_inputs(pattern, start, 1)
            positions = torch.cat([torch.arange(t), t + torch.arange(cell + 1)[cells]])
            assert mask.shape == (3, 1, 1, len(positions))
            seen = torch.zeros(3, start + 1, dtype=torch.bool)
            seen[:, positions] = mask[:, 0, 0]
            reference = pattern_mask(pattern, cfg, keep, q_pos=torch.tensor([start]), num_keys=start + 1)[:, 0]
            assert torch.equal(seen, reference), (pattern, cell)
            if pattern != "full":
                assert len(positions) - t <= (conv_kernel // 2 + 1) * cfg.image_width
    _, bias = state.step_inputs("axial_col", t + 7, 1, torch.float32)
    assert torch.equal(torch.isfinite(bias), state.step_inputs("axial_col", t + 7, 1)[1])
    assert state.step_inputs("axial_row", 2, t)[0] is None, "prefill attends over every key"


@pytest.mark.parametrize("options", OPTIONS)
def test_cached_decoding_under_bf16_autocast_follows_fp32(options):
    torch.manual_seed(0)
    cfg = small_config(**options)
    model = DalleTransformer(cfg)
    text, _ = random_batch(cfg)
    _, reference = generate_images(model, text, temperature=0, return_logits=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, logits = generate_images(model, text, temperature=0, return_logits=True)
    assert torch.isfinite(logits).all()
    cos = torch.nn.functional.cosine_similarity(logits[:, 0].flatten(), reference[:, 0].flatten(), dim=0)
    assert cos > 0.99, cos


def test_sampling_is_seeded_and_respects_top_k_and_top_p():
    torch.manual_seed(0)
    cfg = small_config(rotary=False)  # the learned absolute positions path decodes too
    model = DalleTransformer(cfg)
    text, _ = random_batch(cfg)
    a = generate_images(model, text, seed=7, top_k=5)
    b = generate_images(model, text, seed=7, top_k=5)
    c = generate_images(model, text, seed=8, top_k=5)
    assert torch.equal(a, b) and not torch.equal(a, c)
    greedy = generate_images(model, text, temperature=0)
    assert torch.equal(greedy, generate_images(model, text, temperature=0, seed=99))
    # top-1 sampling is greedy decoding.
    assert torch.equal(generate_images(model, text, seed=1, top_k=1), greedy)

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[True, True, False, False, False]]
    probs = logits.softmax(-1)[0]  # 0.64, 0.24, 0.09, ...: top-p 0.75 keeps the first two
    assert probs[0] < 0.75 < probs[0] + probs[1]
    assert torch.isfinite(filter_logits(logits, top_p=0.75)).tolist() == [[True, True, False, False, False]]
    assert torch.isfinite(filter_logits(logits, top_p=0.5)).tolist() == [[True, False, False, False, False]]


def test_temperature_reshapes_only_what_the_filter_kept_on_the_raw_logits():
    """Top-p 0.75 on raw logits [4, 3, 2, 1, 0] keeps two tokens (0.64 + 0.24). Dividing by the
    temperature first would keep three at T=2 (0.43, 0.26, 0.16) and one at T=0.5 (0.87)."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]]).expand(4000, -1)
    g = torch.Generator().manual_seed(0)
    for temperature in (2.0, 0.5):
        drawn = sample_next(logits, temperature=temperature, top_k=None, top_p=0.75, generator=g)
        assert set(drawn.tolist()) == {0, 1}, temperature
    hot = sample_next(logits, temperature=2.0, top_k=None, top_p=0.75, generator=g).float().mean().item()
    cold = sample_next(logits, temperature=0.5, top_k=None, top_p=0.75, generator=g).float().mean().item()
    assert cold < 0.2 < hot, "the temperature still sharpens or flattens the survivors"


def test_samplers_default_to_one_filter_and_flags_choose_exactly_what_was_given():
    import argparse
    import inspect

    from crowdtrain.data import cli as data_cli
    from crowdtrain.data.config import GenerateConfig
    from crowdtrain.data.evaluate import evaluate_generator
    from crowdtrain.data.generate import Generator

    assert (DEFAULT_TOP_K is None) != (DEFAULT_TOP_P is None), "the paper: top-k 256 or top-p 0.75, not both"
    assert (DEFAULT_TOP_K, DEFAULT_TOP_P) == (None, 0.75), "nucleus: independent of the vocabulary's size"
    defaults = lambda f: {k: v.default for k, v in inspect.signature(f).parameters.items()}
    for sampler in (generate_images, evaluate_generator, Generator.sample):
        d = defaults(sampler)
        assert (d["top_k"], d["top_p"]) == (DEFAULT_TOP_K, DEFAULT_TOP_P), sampler
    assert (GenerateConfig().top_k, GenerateConfig().top_p) == (DEFAULT_TOP_K, DEFAULT_TOP_P)

    parser = argparse.ArgumentParser()
    data_cli.register(parser.add_subparsers())
    for command in (["generate", "--checkpoint", "c", "a red circle"], ["eval", "--checkpoint", "c"]):
        resolve = lambda *flags: data_cli._resolved_filters(parser.parse_args(command + list(flags)))
        assert resolve() == (DEFAULT_TOP_K, DEFAULT_TOP_P)
        assert resolve("--top-p", "0.9") == (None, 0.9)
        assert resolve("--top-k", "64") == (64, None), "top-k alone replaces the default nucleus"
        assert resolve("--top-k", "256", "--top-p", "0.75") == (256, 0.75), "both on request"
        assert resolve("--top-k", "0", "--top-p", "0.9") == (None, 0.9)
    with pytest.raises(ValueError, match="--top-p"):
        sampling_filters(top_p=1.5)
    # Both given: top-k first, then the nucleus of the renormalised survivors.
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    assert torch.isfinite(filter_logits(logits, top_k=3, top_p=0.7)).tolist() == [[True, True, False, False, False]]


# ---- training ----------------------------------------------------------------------------
def test_tiny_preset_learns_a_fixed_batch():
    """The tiny preset memorises a small batch in seconds; checked-in expected loss range."""
    torch.manual_seed(0)
    cfg = get_preset("tiny")
    model = DalleTransformer(cfg)
    text, image = random_batch(cfg, batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model(text, image).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # Start: about ln(64)=4.16 for codes and ln(256)=5.5 for text; after 60 steps on one
    # batch the model has memorised most of it.
    assert 4.0 < losses[0] < 4.6, losses[0]
    assert losses[-1] < 1.5, losses[-1]


@pytest.mark.parametrize("reversible", [False, True])
def test_bf16_autocast_matches_fp32_closely(reversible):
    """Mixed precision as on a GPU peer; on CPU autocast runs bf16 matmuls too."""
    torch.manual_seed(0)
    cfg = small_config(reversible=reversible)
    model = DalleTransformer(cfg)
    text, image = random_batch(cfg)
    reference = model(text, image).loss
    reference.backward()
    ref_grad = model.embedding.weight.grad.clone()
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(text, image).loss
    loss.backward()
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    assert abs(loss.item() - reference.item()) < 0.05 * reference.item()
    cos = torch.nn.functional.cosine_similarity(model.embedding.weight.grad.flatten(), ref_grad.flatten(), dim=0)
    assert cos > 0.95, cos
