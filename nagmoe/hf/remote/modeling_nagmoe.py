"""A nagmoe model for Hugging Face `transformers` (remote code): `AutoModelForCausalLM.from_pretrained(dir,
trust_remote_code=True)`. Inference only, eager, every variant nagmoe trains: pre-norm and NAG residual
streams, MHA and CCA, dense and MoE FFNs, and Mixture-of-Depths with the thresholds the run exported (a dense
reference: every token runs every sublayer and the stream keeps the executed tokens' outputs, so only the FLOP
saving is lost). Logits are fp32.

Self-contained: imports the standard library, torch, transformers and its sibling files only (nagmoe's own
package is never needed; `nag_math.py` is a byte copy of nagmoe/ops/nag_math.py, the equations' one source).
Module and parameter names are nagmoe's, under the prefix `model.`.

Legend: B batch, T new tokens, L key positions, D width, V vocabulary, C modulator directions.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_nagmoe import NagMoeConfig
from .layers_nagmoe import (CompressedConvAttention, Context, DenseMLP, LayerCache, Linear, MoELayer,
                            MultiHeadAttention, rms_norm)
from .nag_math import modulator, nag_update, rms_normalise, rotation_score

_TINY = 1e-12


class NagMoeCache:
    """Decoding state of the whole model: one LayerCache per block and the positions consumed so far."""

    def __init__(self, n_layers: int):
        self.layers = [LayerCache() for _ in range(n_layers)]
        self.length = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        for layer in self.layers:
            for name in ("k_BKLS", "v_BKLS", "conv_BCW", "shift_BN"):
                t = getattr(layer, name)
                if t is not None:
                    setattr(layer, name, t.index_select(0, beam_idx.to(t.device)))


# ----------------------------------------------------------------------------------------------------------
# NAG gates and Mixture-of-Depths thresholds
# ----------------------------------------------------------------------------------------------------------
class NAGGate(nn.Module):
    """One sublayer's gate: modulator directions (C, D), bias, coef, beta_raw, alpha and the MoD base vector."""

    def __init__(self, d_model: int, n_directions: int, floor: float, mod_base: bool):
        super().__init__()
        self.floor = floor
        self.weight = nn.Parameter(torch.zeros(n_directions, d_model))
        self.bias = nn.Parameter(torch.zeros(n_directions))
        self.coef = nn.Parameter(torch.zeros(n_directions))
        self.beta_raw = nn.Parameter(torch.zeros(()))
        self.alpha = nn.Parameter(torch.zeros(()))
        self.base = nn.Parameter(torch.zeros(d_model)) if mod_base else None


class MoDThresholds(nn.Module):
    """The calibrator's saved buffers (nagmoe/model/mod_calibration.py): a token executes sublayer l when the
    sublayer skips (`skipping[l]`, eligible) and its rotation score exceeds `threshold[l]`. The histograms and
    counters ride along for the compute dial. `last_masks`: the executed masks of the last forward."""

    def __init__(self, n_sublayers: int, bins: int, eligible: list):
        super().__init__()
        self.eligible = [bool(e) for e in eligible]
        f64 = torch.float64
        self.register_buffer("threshold", torch.zeros(n_sublayers, dtype=torch.float32))
        self.register_buffer("histogram", torch.zeros(n_sublayers, bins, dtype=f64))
        self.register_buffer("correction", torch.zeros(n_sublayers, dtype=f64))
        self.register_buffer("skipping", torch.zeros(n_sublayers, dtype=torch.bool))
        self.register_buffer("tokens_seen", torch.zeros((), dtype=f64))
        self.register_buffer("executed_total", torch.zeros(n_sublayers, dtype=f64))
        self.register_buffer("tokens_total", torch.zeros((), dtype=f64))
        self.last_masks: dict = {}

    def executes(self, index: int, score_BT: torch.Tensor) -> Optional[torch.Tensor]:
        """The executed mask of sublayer `index` (None: every token)."""
        if not self.eligible[index] or not bool(self.skipping[index]):
            self.last_masks[index] = None
            return None
        mask_BT = score_BT > self.threshold[index]
        self.last_masks[index] = mask_BT
        return mask_BT


def nag_decode_weight(w_VD: torch.Tensor) -> torch.Tensor:
    """The unembedding rows centred and brought to RMS 1 (NAG's decode reads directions only)."""
    w_VD = w_VD.float()
    return rms_normalise(w_VD - w_VD.mean(-1, keepdim=True))


class NAGStream(nn.Module):
    """encode: e = centre(wte[idx]); s = log RMS(e) + g_encode; R̄ = e / RMS(e).
    apply: m = modulator(R̄); g = alpha·m·warmup; f = F(R̄) (+ X_l under MoD, F only where executed);
    (s, R̄) <- nag_update.  decode: logits = exp(s)/d · <rms(R̄), rms(centre(W_U))[v]>, fp32."""

    def __init__(self, config: NagMoeConfig):
        super().__init__()
        model, layout = config.nagmoe_model, config.layout
        nag, n = model["nag"], 2 * model["n_layers"]
        self.d_model, self.eps = model["d_model"], nag["eps"]
        mod_on = model["mod"]["skip_rate"] > 0
        self.g_encode = nn.Parameter(torch.zeros(()))
        self.gates = nn.ModuleList(NAGGate(model["d_model"], nag["C"], nag["gain_floor"], mod_on) for _ in range(n))
        self.mod = MoDThresholds(n, layout["mod_bins"], layout["mod_eligible"]) if mod_on else None
        # the trainer's injection warm-up factor; 1 for a trained model (set again by _init_weights on load)
        self.register_buffer("injection_warmup", torch.ones((), dtype=torch.float32), persistent=False)

    def encode(self, wte: nn.Embedding, idx_BT: torch.Tensor):
        e_BTD = wte(idx_BT).float()
        e_BTD = e_BTD - e_BTD.mean(-1, keepdim=True)
        mean_sq_BT = e_BTD.pow(2).mean(-1)
        log_norm_BT = 0.5 * torch.log(mean_sq_BT + _TINY) + self.g_encode.float()
        return log_norm_BT, e_BTD * torch.rsqrt(mean_sq_BT + _TINY).unsqueeze(-1)

    def apply(self, index: int, sublayer, state):
        log_norm_BT, direction_BTD = state
        gate = self.gates[index]
        m_BT = modulator(direction_BTD, gate.weight.float(), gate.bias.float(), gate.coef.float(), gate.beta_raw,
                         gate.floor)
        scale_BT = gate.alpha.float() * m_BT * self.injection_warmup
        f_BTD = sublayer(direction_BTD).float()
        if self.mod is not None:
            mask_BT = self.mod.executes(index, rotation_score(gate.alpha.detach(), m_BT))
            base_D = gate.base.float()
            f_BTD = f_BTD + base_D if mask_BT is None else torch.where(mask_BT.unsqueeze(-1), f_BTD + base_D, base_D)
        return nag_update(log_norm_BT, direction_BTD, f_BTD, scale_BT, self.eps)

    def decode(self, state, lm_head: nn.Linear) -> torch.Tensor:
        log_norm_BT, direction_BTD = state
        w_VD = nag_decode_weight(lm_head.weight)
        a_BTD = rms_normalise(direction_BTD.float()) * (log_norm_BT.float().exp() / self.d_model).unsqueeze(-1)
        return F.linear(a_BTD, w_VD)


class PreNormStream(nn.Module):
    """x0 = rms(wte[idx]); x <- x + F(rms(x)); logits = cap·tanh(lm_head(rms(x)) / cap) (cap <= 0: none)."""

    def __init__(self, config: NagMoeConfig):
        super().__init__()
        self.logit_softcap = config.nagmoe_model["logit_softcap"]

    def encode(self, wte: nn.Embedding, idx_BT: torch.Tensor):
        return rms_norm(wte(idx_BT).float())

    def apply(self, index: int, sublayer, x_BTD):
        return x_BTD + sublayer(rms_norm(x_BTD)).float()

    def decode(self, x_BTD, lm_head: nn.Linear) -> torch.Tensor:
        logits_BTV = F.linear(rms_norm(x_BTD).float(), lm_head.weight.float())
        if self.logit_softcap > 0:
            logits_BTV = self.logit_softcap * torch.tanh(logits_BTV / self.logit_softcap)
        return logits_BTV


# ----------------------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, config: NagMoeConfig):
        super().__init__()
        model, layout = config.nagmoe_model, config.layout
        attention = CompressedConvAttention if model["attention"]["kind"] == "cca" else MultiHeadAttention
        self.attn = attention(layout, model["d_model"])
        if model["ffn"] == "moe":
            moe = model["moe"]
            self.ffn = MoELayer(model["d_model"], moe["n_experts"], moe["top_k"], layout["ffn_hidden"],
                                expert_bias=bool(layout.get("expert_bias", False)))
        else:
            self.ffn = DenseMLP(model["d_model"], layout["ffn_hidden"])


class NagMoePreTrainedModel(PreTrainedModel):
    config_class = NagMoeConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _tied_weights_keys: dict = {}
    _supports_param_buffer_assignment = False

    def _init_weights(self, module):
        """Only what a load leaves unset: the non-persistent warm-up factor (1 for a trained model). Every
        persistent tensor comes from the checkpoint; the export's validation refuses a missing one."""
        from transformers import initialization as init

        if isinstance(module, NAGStream):
            init.ones_(module.injection_warmup)


class NagMoeModel(NagMoePreTrainedModel):
    def __init__(self, config: NagMoeConfig):
        super().__init__(config)
        model = config.nagmoe_model
        self.wte = nn.Embedding(model["vocab_size"], model["d_model"])
        self.blocks = nn.ModuleList(Block(config) for _ in range(model["n_layers"]))
        self.lm_head = Linear(model["d_model"], model["vocab_size"], bias=False)
        self.stream = NAGStream(config) if model["residual"] == "nag" else PreNormStream(config)
        self.post_init()

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[NagMoeCache] = None) -> torch.Tensor:
        B, T = input_ids.shape
        past = cache.length if cache is not None else 0
        device = input_ids.device
        if attention_mask is not None and not bool(attention_mask.all()):
            valid_BL = attention_mask[:, -(past + T):].bool()
            positions_BT = (valid_BL.long().cumsum(1) - 1).clamp_min(0)[:, past:]
            valid_BT = valid_BL[:, past:]
        else:
            valid_BL = valid_BT = None
            positions_BT = torch.arange(past, past + T, device=device).expand(B, T)
        query_BT1 = torch.arange(past, past + T, device=device).view(1, T, 1)
        key_L = torch.arange(past + T, device=device).view(1, 1, -1)
        visible_BTL = key_L <= query_BT1  # causal
        if valid_BL is not None:  # padded keys hidden; a padded query sees itself (no empty softmax row)
            visible_BTL = visible_BTL & (valid_BL.unsqueeze(1) | (key_L == query_BT1))
        ctx = Context(positions_BT, valid_BT, visible_BTL.expand(B, T, past + T), cache)
        state = self.stream.encode(self.wte, input_ids)
        for i, block in enumerate(self.blocks):
            layer_cache = cache.layers[i] if cache is not None else None
            state = self.stream.apply(2 * i, lambda x, a=block.attn, c=layer_cache: a(x, ctx, c), state)
            state = self.stream.apply(2 * i + 1, block.ffn, state)
        if cache is not None:
            cache.length = past + T
        return self.stream.decode(state, self.lm_head)


class NagMoeForCausalLM(NagMoePreTrainedModel, GenerationMixin):
    def __init__(self, config: NagMoeConfig):
        super().__init__(config)
        self.model = NagMoeModel(config)
        # strict fp32 by role (nagmoe/model/roles.py: everything but matrices, embedding and unembedding)
        self._keep_in_fp32_modules_strict = set((config.layout or {}).get("fp32_keys", []))
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # our own cache (NagMoeCache: KV plus CCA's conv and value-shift state)

    def get_input_embeddings(self):
        return self.model.wte

    def get_output_embeddings(self):
        return self.model.lm_head

    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True,
                                      **kwargs):
        if past_key_values is not None and past_key_values.length > 0:
            input_ids = input_ids[:, past_key_values.length:]
        return {"input_ids": input_ids, "past_key_values": past_key_values, "attention_mask": attention_mask,
                "use_cache": use_cache}

    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                past_key_values: Optional[NagMoeCache] = None, use_cache: Optional[bool] = None,
                labels: Optional[torch.Tensor] = None, **kwargs) -> CausalLMOutputWithPast:
        if use_cache and past_key_values is None:
            past_key_values = NagMoeCache(len(self.model.blocks))
        logits_BTV = self.model(input_ids, attention_mask, past_key_values if use_cache else None)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits_BTV[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits_BTV, past_key_values=past_key_values if use_cache
                                      else None)
