"""Independent PyTorch reference of the DFlash drafter forward, for tests only.

Written from the specification (shared DFLASH.md, section 2), not from the JAX code. It reads:
- the drafter from a z-lab format directory (config.json + model.safetensors, PyTorch [out, in]
  weights, optional `model.` prefix) with safetensors.torch and strict state-dict loading, so the
  checkpoint format is checked too;
- the target from a Hugging Face directory through transformers (AutoModelForCausalLM).

`RefDrafter.draft_logits(target, prefix_ids, block_size)` returns the B-1 draft logits after the
prefix (last id = anchor): target hidden_states[l+1] taps of the context -> fc -> hidden_norm = C;
every layer attends from the block rows to [C ; block] with K/V injection, RoPE at absolute
positions, full non-causal attention (or, for sliding_attention layers, causal within the window over
the concatenated positions); final norm; the target's lm_head.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


def reference_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Spec formula: ids[i] = round(1 + i*(N-4)/(n-1)); n == 1 -> [N//2]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    step = (num_target_layers - 4) / (num_draft_layers - 1)
    return [round(1 + i * step) for i in range(num_draft_layers)]


class _Attn(nn.Module):
    def __init__(self, H, NH, KV, D, eps, bias=False):
        super().__init__()
        self.q_proj = nn.Linear(H, NH * D, bias=bias)
        self.k_proj = nn.Linear(H, KV * D, bias=bias)
        self.v_proj = nn.Linear(H, KV * D, bias=bias)
        self.o_proj = nn.Linear(NH * D, H, bias=bias)
        self.q_norm = Qwen3RMSNorm(D, eps)
        self.k_norm = Qwen3RMSNorm(D, eps)


class _Layer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = _Attn(H, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, eps,
                               bias=cfg.attention_bias)
        self.mlp = Qwen3MLP(cfg)
        self.input_layernorm = Qwen3RMSNorm(H, eps)
        self.post_attention_layernorm = Qwen3RMSNorm(H, eps)


class RefDrafter(nn.Module):
    ARCHITECTURE = "DFlashDraftModel"

    def __init__(self, raw: dict):
        super().__init__()
        self.raw = raw
        cfg = Qwen3Config(
            hidden_size=raw["hidden_size"], intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"], num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=raw.get("num_key_value_heads") or raw["num_attention_heads"],
            head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=raw.get("rope_theta", 10000.0),
            rope_scaling=raw.get("rope_scaling"), max_position_embeddings=raw.get("max_position_embeddings", 32768),
            vocab_size=raw["vocab_size"], hidden_act=raw.get("hidden_act", "silu"),
            attention_bias=bool(raw.get("attention_bias", False)))
        self.cfg = cfg
        dcfg = raw.get("dflash_config") or {}
        n = cfg.num_hidden_layers
        self.layer_ids = list(dcfg.get("target_layer_ids") or reference_layer_ids(raw["num_target_layers"], n))
        self.mask_token_id = int(dcfg["mask_token_id"])
        self.block_size = int(raw.get("block_size", 16))
        types = raw.get("layer_types") or ["full_attention"] * n
        self.windows = [int(raw["sliding_window"]) if t == "sliding_attention" else 0 for t in types]
        H = cfg.hidden_size
        self.fc = nn.Linear(len(self.layer_ids) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([_Layer(cfg) for _ in range(n)])
        self.norm = Qwen3RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg)  # non-persistent buffers only

    @classmethod
    def from_dir(cls, path: str, dtype=torch.float64) -> "RefDrafter":
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        assert raw["architectures"] == [cls.ARCHITECTURE], raw["architectures"]
        model = cls(raw)
        sd = load_file(os.path.join(path, "model.safetensors"))
        if all(k.startswith("model.") for k in sd):
            sd = {k[len("model."):]: v for k, v in sd.items()}
        model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=True)
        return model.to(dtype).eval()

    # ------------------------------------------------------------------------------------------
    def _rope(self, x, positions):
        """x [NH, T, D], positions [T] (absolute) -> x rotated (rotate-half convention)."""
        cos, sin = self.rotary(x, positions[None])  # [1, T, D]
        return x * cos + rotate_half(x) * sin

    def _layer(self, layer: _Layer, window: int, x, C, ctx_pos, blk_pos):
        cfg = self.cfg
        NH, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = layer.self_attn
        Q, T = x.shape[0], C.shape[0]
        xn = layer.input_layernorm(x)  # block rows only; C gets no input norm
        both = torch.cat([C, xn], dim=0)  # [T + Q, H]: context rows first
        q = a.q_norm(a.q_proj(xn).view(Q, NH, D)).transpose(0, 1)  # [NH, Q, D]
        k = a.k_norm(a.k_proj(both).view(T + Q, KV, D)).transpose(0, 1)  # [KV, T+Q, D]
        v = a.v_proj(both).view(T + Q, KV, D).transpose(0, 1)
        key_pos = torch.cat([ctx_pos, blk_pos])
        q = self._rope(q, blk_pos)
        k = self._rope(k, key_pos)
        k = k.repeat_interleave(NH // KV, dim=0)
        v = v.repeat_interleave(NH // KV, dim=0)
        scores = (q @ k.transpose(1, 2)) * D ** -0.5  # [NH, Q, T+Q]
        if window:
            rel = blk_pos[:, None] - key_pos[None, :]
            allowed = (rel >= 0) & (rel < window)
            scores = scores.masked_fill(~allowed, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = (p @ v).transpose(0, 1).reshape(Q, NH * D)
        h = x + a.o_proj(o)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    @torch.no_grad()
    def draft_logits(self, target, prefix_ids, block_size: int | None = None) -> torch.Tensor:
        """prefix_ids: context ids + anchor id (>= 2 ids) -> draft logits [B-1, V] (target dtype)."""
        h = self.draft_hidden(target, prefix_ids, block_size)
        head = target.get_output_embeddings()
        return head(h.to(head.weight.dtype))

    @torch.no_grad()
    def draft_hidden(self, target, prefix_ids, block_size: int | None = None) -> torch.Tensor:
        """The final-normed hidden [B-1, H] of the draft slots after the prefix."""
        B = block_size or self.block_size
        ids = torch.as_tensor(list(prefix_ids), dtype=torch.long)
        ctx, anchor = ids[:-1], ids[-1]
        T = ctx.numel()
        out = target(input_ids=ctx[None], output_hidden_states=True)
        hs = out.hidden_states  # [embeddings, layer 0 output, ..., normed final]
        feats = torch.cat([hs[l + 1][0] for l in self.layer_ids], dim=-1).to(self.fc.weight.dtype)
        C = self.hidden_norm(self.fc(feats))  # [T, H]
        block_ids = torch.full((B,), self.mask_token_id, dtype=torch.long)
        block_ids[0] = anchor
        x = target.get_input_embeddings()(block_ids).to(C.dtype)
        ctx_pos = torch.arange(T)
        blk_pos = torch.arange(T, T + B)
        for layer, window in zip(self.layers, self.windows):
            x = self._layer(layer, window, x, C, ctx_pos, blk_pos)
        return self.norm(x)[1:]


def load_hf_target(path: str, dtype=torch.float64):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    return model.eval()


# ----------------------------------------------------------------------------------------------
# DFlash2 (shared DFLASH.md, section 11)
# ----------------------------------------------------------------------------------------------
class _Conv(nn.Module):
    """Grouped dynamic causal conv over the block rows: out_i[c] = sum_{t<K} (base[s,t,c] + D_i[s,t,c // gs]) y_{i-t}[c],
    D_i = kernel_projection(xn_i) viewed [2, K, G]."""

    def __init__(self, H, K, group_size):
        super().__init__()
        self.K, self.G = K, H // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, K, H))
        self.kernel_projection = nn.Linear(H, 2 * K * self.G, bias=False)

    def forward(self, xn, y, side):
        Q, H = y.shape
        D = self.kernel_projection(xn).view(Q, 2, self.K, self.G)[:, side]  # [Q, K, G]
        group = torch.arange(H) // (H // self.G)  # channel c -> its group
        out = torch.zeros_like(y)
        for i in range(Q):
            for t in range(min(self.K, i + 1)):
                out[i] += (self.base_kernel[side, t] + D[i, t, group]) * y[i - t]
        return out


class _Selector(nn.Module):
    def __init__(self, H, V, R):
        super().__init__()
        self.hidden_projection = nn.Linear(H, R, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(V, R))
        self.successor_codebook = nn.Parameter(torch.zeros(V, R))


class RefDrafter2(RefDrafter):
    """The DFlash2 drafter: v1 layers with a conv before (side 0, on the normed input) and after (side 1, on the
    output) each sublayer, kernels from the sublayer's normed input; the candidate selector's argmax walk."""
    ARCHITECTURE = "DFlash2DraftModel"

    def __init__(self, raw: dict):
        super().__init__(raw)
        d = raw["dflash_config"]
        H, V = raw["hidden_size"], raw["vocab_size"]
        self.block_size = int(d.get("block_size", self.block_size))
        self.top_k = int(d["selector_top_k"])
        self.mult = float(d.get("output_multiplier", 1.0))
        self.cap = d.get("final_logit_softcapping")
        for layer in self.layers:
            layer.attention_conv = _Conv(H, int(d["conv_kernel_size"]), int(d["conv_group_size"]))
            layer.mlp_conv = _Conv(H, int(d["conv_kernel_size"]), int(d["conv_group_size"]))
        self.candidate_selector = _Selector(H, V, int(d["selector_rank"]))

    def _layer(self, layer, window, x, C, ctx_pos, blk_pos):
        cfg = self.cfg
        NH, KV, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        a = layer.self_attn
        Q, T = x.shape[0], C.shape[0]
        xn = layer.input_layernorm(x)
        xin = layer.attention_conv(xn, xn, 0)
        both = torch.cat([C, xin], dim=0)
        q = self._rope(a.q_norm(a.q_proj(xin).view(Q, NH, D)).transpose(0, 1), blk_pos)
        k = a.k_norm(a.k_proj(both).view(T + Q, KV, D)).transpose(0, 1)
        v = a.v_proj(both).view(T + Q, KV, D).transpose(0, 1)
        key_pos = torch.cat([ctx_pos, blk_pos])
        k = self._rope(k, key_pos).repeat_interleave(NH // KV, dim=0)
        v = v.repeat_interleave(NH // KV, dim=0)
        scores = (q @ k.transpose(1, 2)) * D ** -0.5
        if window:
            rel = blk_pos[:, None] - key_pos[None, :]
            scores = scores.masked_fill(~((rel >= 0) & (rel < window)), float("-inf"))
        o = a.o_proj((torch.softmax(scores, dim=-1) @ v).transpose(0, 1).reshape(Q, NH * D))
        h = x + layer.attention_conv(xn, o, 1)
        hn = layer.post_attention_layernorm(h)
        return h + layer.mlp_conv(hn, layer.mlp(layer.mlp_conv(hn, hn, 0)), 1)

    @torch.no_grad()
    def unary(self, target, prefix_ids, block_size=None):
        """u [B-1, V] = softcap(output_multiplier * lm_head(h)) and the hidden h [B-1, H]."""
        h = self.draft_hidden(target, prefix_ids, block_size)
        head = target.get_output_embeddings()
        u = head(h.to(head.weight.dtype)) * self.mult
        if self.cap:
            u = self.cap * torch.tanh(u / self.cap)
        return u, h

    @torch.no_grad()
    def greedy_drafts(self, target, prefix_ids, block_size=None) -> list[int]:
        """The selector's argmax walk: predecessor = the anchor, then each chosen token."""
        u, h = self.unary(target, prefix_ids, block_size)
        sel = self.candidate_selector
        wh = sel.hidden_projection(h.to(sel.hidden_projection.weight.dtype))
        prev, out = int(prefix_ids[-1]), []
        for i in range(u.shape[0]):
            cand = torch.topk(u[i], self.top_k).indices
            s = u[i, cand] + (sel.predecessor_codebook[prev] * wh[i]) @ sel.successor_codebook[cand].T
            prev = int(cand[int(torch.argmax(s))])
            out.append(prev)
        return out
