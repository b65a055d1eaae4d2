"""torch's own layers and transformers models beyond GPT-2 (ResNet, Swin, Bart, CLIP, Whisper, LSTM, GRU, ...) with
their inputs and losses, and one plan of each kind for a profile of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import helpers.whole_step as ws
from memopt_nb.core.plan import Plan


class RNNLM(nn.Module):
    def __init__(self, rnn: type = nn.LSTM) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.rnn1 = rnn(32, 48, batch_first=True)
        self.rnn2 = rnn(48, 32, batch_first=True, num_layers=2, dropout=0.1)
        self.head = nn.Linear(32, 64)

    def forward(self, x):
        h, _ = self.rnn1(self.emb(x))
        h, _ = self.rnn2(h)
        return self.head(h)


class WeightNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        wn = nn.utils.parametrizations.weight_norm
        self.blocks = nn.ModuleList([nn.Sequential(wn(nn.Linear(32, 64)), nn.GELU(), wn(nn.Linear(64, 32)))
                                     for _ in range(3)])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
        self.head = nn.Linear(32, 10)

    def forward(self, x, mask=None):
        return self.head(self.enc(x, src_key_padding_mask=mask).mean(1))


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.att = nn.ModuleList([nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True) for _ in range(3)])
        self.ln = nn.ModuleList([nn.LayerNorm(32) for _ in range(3)])
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        for att, ln in zip(self.att, self.ln, strict=True):
            y = ln(x)
            x = x + att(y, y, y, need_weights=False)[0]
        return self.head(x.mean(1))


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Conv2d(8 if i else 3, 8, 3, padding=1), nn.GroupNorm(2, 8),
                                                    nn.SiLU()) for i in range(4)])
        self.head = nn.Linear(8, 10)
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        return self.head(self.blocks(x).mean((2, 3)))


def _sq(out):
    return out.float().pow(2).mean()


_g = torch.Generator().manual_seed(0)


TOKENS = torch.randint(0, 64, (4, 12), generator=_g)
SEQ = torch.randn(4, 10, 32, generator=_g)


IMAGES = torch.randn(4, 3, 16, 16, generator=_g).to(memory_format=torch.channels_last)
IMAGES32 = torch.randn(4, 3, 32, 32, generator=_g)


LABELS = torch.randint(0, 10, (4,), generator=_g)
PADDED = torch.zeros(4, 10, dtype=torch.bool)
PADDED[1, 7:] = True


def _lm_loss(out):
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), TOKENS.reshape(-1))


def _hf_resnet():
    transformers = pytest.importorskip("transformers")
    return transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10))


def _hf_swin():
    transformers = pytest.importorskip("transformers")
    return transformers.SwinForImageClassification(transformers.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[2, 2], num_heads=[2, 2], window_size=4, num_labels=10,
        hidden_dropout_prob=0.1))


def _bart():
    transformers = pytest.importorskip("transformers")
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.1))


def _clip():
    transformers = pytest.importorskip("transformers")
    return transformers.CLIPModel(transformers.CLIPConfig(
        text_config=dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=1),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8)))


def _whisper():
    transformers = pytest.importorskip("transformers")
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=16, max_source_positions=32,
        max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1))


IDS = torch.randint(0, 96, (2, 16), generator=_g)
IDS_MASK = torch.ones(2, 16, dtype=torch.long)
IDS_MASK[1, 12:] = 0


FEATURES = torch.randn(2, 16, 64, generator=_g)
PIXELS = torch.randn(2, 3, 32, 32, generator=_g)


def _out_loss(out):
    return out.loss


# name: (build, positional inputs, keyword inputs, loss)
MODELS = {
    "lstm": (RNNLM, (TOKENS,), {}, _lm_loss),
    "gru": (lambda: RNNLM(nn.GRU), (TOKENS,), {}, _lm_loss),
    "weight_norm": (WeightNormMLP, (SEQ,), {}, _sq),
    "transformer_encoder": (Encoder, (SEQ,), {"mask": PADDED}, _sq),
    "self_attention": (SelfAttention, (SEQ,), {}, _sq),
    "channels_last": (ChannelsLast, (IMAGES,), {}, _sq),
    "hf_resnet": (_hf_resnet, (), {"pixel_values": IMAGES32, "labels": LABELS}, _out_loss),
    "hf_swin": (_hf_swin, (), {"pixel_values": IMAGES32, "labels": LABELS}, _out_loss),
    "hf_bart": (_bart, (), {"input_ids": IDS, "attention_mask": IDS_MASK, "labels": IDS[:, :8].contiguous()},
                _out_loss),
    "hf_clip": (_clip, (), {"input_ids": IDS, "attention_mask": IDS_MASK, "pixel_values": PIXELS,
                            "return_loss": True}, _out_loss),
    "hf_whisper": (_whisper, (), {"input_features": FEATURES, "labels": IDS[:, :8].contiguous()}, _out_loss),
}


def _placed(prof, rows, opt, step_in_backward: bool = False) -> Plan:
    """``test_whole_step_apply``'s rows (cycled) over the units that have parameters; the others keep, resident (a
    planner offers no placement there)."""
    cycle = iter(rows * prof.n_units)
    plan = ws._whole(Plan.uniform(prof, "keep"),
                     [next(cycle) if u.param_bytes else ("keep", "resident", "resident", "resident")
                      for u in prof.units], step_in_backward=step_in_backward, opt=opt)
    assert plan.moves_state
    return plan


def _plans(prof, opt) -> dict[str, Plan]:
    plans = {s: Plan.from_strategies(prof, [s if u.recomputable or s == "swap" else "keep" for u in prof.units])
             for s in ("recompute", "swap", "recompute_offload")}
    plans["whole"] = _placed(prof, ws.MIXED, opt)
    plans["whole_step"] = _placed(prof, ws.MIXED_STEP, opt, step_in_backward=True)
    return plans
