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
from crowdtrain.model.info import build_meta_model, model_info
from crowdtrain.model.sampling import filter_logits

PATTERNS = ["full", "axial_row", "axial_col", "conv_like"]


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


def test_config_round_trips_through_dict_and_fingerprint_tracks_architecture():
    cfg = get_preset("paper")
    again = ModelConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.fingerprint() == cfg.fingerprint()
    assert dataclasses.replace(cfg, checkpointing=True).fingerprint() == cfg.fingerprint()
    assert dataclasses.replace(cfg, width=512, head_dim=32).fingerprint() != cfg.fingerprint()
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
def test_reversible_gradients_equal_plain_autograd_of_the_same_coupling():
    torch.manual_seed(0)
    cfg = small_config(reversible=True)
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


def test_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    cfg = small_config()
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
@pytest.mark.parametrize("reversible", [False, True])
def test_cached_decoding_logits_equal_the_full_forward(reversible):
    torch.manual_seed(0)
    cfg = small_config(reversible=reversible, rotary=True)
    model = DalleTransformer(cfg).double()
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


def test_cached_decoding_under_bf16_autocast_follows_fp32():
    torch.manual_seed(0)
    cfg = small_config()
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
