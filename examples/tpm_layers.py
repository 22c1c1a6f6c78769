"""The torch model of tp_decode's model ranks: a compact Llama-style decoder with tensor
parallelism, its weights and its forward pieces (no collective here: the op between pieces is a
comm of tpm_comms.py).

Model: replicated embedding and lm_head; per layer RMSNorm -> attention (column-parallel fused
QKV, rotary embedding, grouped-query attention over a KV cache, row-parallel o_proj) -> RMSNorm
-> SwiGLU MLP (column-parallel gate/up, row-parallel down_proj), residuals: Hugging Face's
LlamaForCausalLM, layer for layer (tp_oracle.py checks that). Weights are random from --seed,
generated whole on every rank (one layer at a time, on the GPU when there is one) and sliced, so
every world size computes the same model.

The forward is pieces 0 .. 2*layers with fused-op site i between piece i and piece i+1 (tp_model.py
says why there are two sites per layer); the pieces are what piecewise CUDA graphs capture.

The tensors a fused op touches (partial: the allreduce input; residual, in place; h: the norm
output; the norm weights) have fixed addresses, which CUDA graphs need. On the in-stream plane
they are ordinary torch tensors (the op takes memory from any allocator); on the eager and
doorbell planes they live in one plain-cudaMalloc buffer registered with the sidecar once
(arfuse.CudaBuffer; a HostShmBuffer on --device cpu).
"""
import dataclasses
from typing import List

import torch
import torch.nn.functional as F

from arfuse.pool import TensorPool


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The framework's RMSNorm with the fused op's numerics (kernels/host/reference_op.h): fp32
    math on the dtype-rounded input, 1/sqrt(mean(x^2) + eps), (x * inv) * weight, one rounding."""
    y = x.float()
    inv = 1.0 / torch.sqrt(y.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((y * inv) * weight.float()).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    half = xf.shape[-1] // 2
    rot = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rot * sin).to(x.dtype)


@dataclasses.dataclass
class LayerWeights:
    wqkv_t: torch.Tensor   # [hidden, (heads_local + 2 * kv_local) * head_dim]  column-parallel
    wo_t: torch.Tensor     # [heads_local * head_dim, hidden]                   row-parallel
    wgu_t: torch.Tensor    # [hidden, 2 * inter_local]                          column-parallel
    wd_t: torch.Tensor     # [inter_local, hidden]                              row-parallel


def generate_weights(cfg, device):
    """The model's weights from the seed, in a fixed order, one layer at a time, fp32 on
    `device` (a generator of its own: the same numbers on every rank and in every process on the
    same kind of device). Yields ("embed", [V, H]), then per layer ("layer", l, {q, k, v, o,
    gate, up, down: [out, in]; input_norm, post_norm: [H]}), then ("final_norm", [H]) and
    ("lm_head", [V, H]): Hugging Face's Llama layout."""
    gdev = device if device.type == "cuda" else torch.device("cpu")
    g = torch.Generator(device=gdev).manual_seed(cfg.seed)
    H, V, hd = cfg.hidden, cfg.vocab, cfg.head_dim
    nh, nkv, inter = cfg.heads, cfg.kv_heads, cfg.intermediate

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float32, device=gdev) * std

    yield ("embed", randn(V, H))
    for layer in range(cfg.layers):
        w = {"q": randn(nh * hd, H, std=H ** -0.5), "k": randn(nkv * hd, H, std=H ** -0.5),
             "v": randn(nkv * hd, H, std=H ** -0.5), "o": randn(H, nh * hd, std=(nh * hd) ** -0.5),
             "gate": randn(inter, H, std=H ** -0.5), "up": randn(inter, H, std=H ** -0.5),
             "down": randn(H, inter, std=inter ** -0.5)}
        w["input_norm"] = 1.0 + 0.1 * randn(H)
        w["post_norm"] = 1.0 + 0.1 * randn(H)
        yield ("layer", layer, w)
    yield ("final_norm", 1.0 + 0.1 * randn(H))
    yield ("lm_head", randn(V, H, std=H ** -0.5))


class Weights:
    """This rank's shard of the model generate_weights() makes (world=1 and dtype float32: the
    fp32 reference, tp_oracle.py). An 80-layer model at 8B sizes never sits whole in memory."""

    def __init__(self, cfg, rank: int, world: int, device, dtype):
        hd = cfg.head_dim
        hl, kvl, il = cfg.heads // world, cfg.kv_heads // world, cfg.intermediate // world
        q = slice(rank * hl * hd, (rank + 1) * hl * hd)
        kv = slice(rank * kvl * hd, (rank + 1) * kvl * hd)
        mi = slice(rank * il, (rank + 1) * il)

        def put(t):
            return t.to(device=device, dtype=dtype).contiguous()

        self.layers: List[LayerWeights] = []
        self.norms: List[torch.Tensor] = []  # in_0, post_0, in_1, post_1, ..., final
        for item in generate_weights(cfg, device):
            if item[0] == "embed":
                self.embed = put(item[1])
            elif item[0] == "layer":
                w = item[2]
                self.norms += [put(w["input_norm"]), put(w["post_norm"])]
                self.layers.append(LayerWeights(
                    wqkv_t=put(torch.cat([w["q"][q], w["k"][kv], w["v"][kv]], 0).t()),
                    wo_t=put(w["o"][:, q].t()),
                    wgu_t=put(torch.cat([w["gate"][mi], w["up"][mi]], 0).t()),
                    wd_t=put(w["down"][:, mi].t())))
            elif item[0] == "final_norm":
                self.norms.append(put(item[1]))
            else:
                self.lm_head_t = item[1].t().contiguous().to(device)  # [H, V] fp32 logits


class TPModel:
    """pool_buffer: the registered buffer the fused op's tensors are carved from (eager and
    doorbell planes), or None for ordinary torch tensors (the in-stream plane, the references).
    """

    def __init__(self, cfg, weights: Weights, pool_buffer, layout, rank: int, world: int,
                 device, dtype):
        self.cfg, self.w, self.rank, self.world = cfg, weights, rank, world
        self.device, self.dtype = device, dtype
        self.cuda = device.type == "cuda"
        H, M, B, S, hd = cfg.hidden, layout.max_tokens, cfg.batch, cfg.max_seq, cfg.head_dim
        self.hl, self.kvl = cfg.heads // world, cfg.kv_heads // world
        self.il = cfg.intermediate // world
        self.sites = cfg.sites
        self.pieces = cfg.sites + 1
        # The fused op's tensors: static, in the registered pool or torch's allocator.
        if pool_buffer is not None:
            pool = TensorPool(pool_buffer)
            self.partial = pool.view(dtype, (M, H), layout.offset("partial"))
            self.residual = pool.view(dtype, (M, H), layout.offset("residual"))
            self.h = pool.view(dtype, (M, H), layout.offset("h"))
            self.gammas = pool.view(dtype, (cfg.sites + 1, H), layout.offset("gamma"))
        else:
            self.partial, self.residual, self.h = (torch.zeros(M, H, device=device, dtype=dtype)
                                                   for _ in range(3))
            self.gammas = torch.zeros(cfg.sites + 1, H, device=device, dtype=dtype)
        self.gammas.copy_(torch.stack(weights.norms).to(device=device, dtype=dtype))
        # Everything else: ordinary torch memory, allocated before any capture.
        self.k_cache = [torch.zeros(B, self.kvl, S, hd, device=device, dtype=dtype)
                        for _ in range(cfg.layers)]
        self.v_cache = [torch.zeros_like(c) for c in self.k_cache]
        self.key_pos = torch.arange(S, device=device)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        f = torch.outer(torch.arange(S, dtype=torch.float32), inv_freq)
        emb = torch.cat([f, f], dim=-1)
        self.cos, self.sin = emb.cos().to(device), emb.sin().to(device)
        self.logits_out = torch.zeros(B, cfg.vocab, dtype=torch.float32, device=device)
        self.next_tok = torch.zeros(B, dtype=torch.long, device=device)
        # Decode's static inputs.
        self.dec_tok = torch.zeros(B, dtype=torch.long, device=device)
        self.dec_pos = torch.zeros(1, dtype=torch.long, device=device)

    def reset(self):
        for c in self.k_cache + self.v_cache:
            c.zero_()

    # -- pieces --
    def piece(self, i: int, tok: torch.Tensor, pos: torch.Tensor, B: int, T: int):
        n = B * T
        if i == 0:
            torch.index_select(self.w.embed, 0, tok, out=self.residual[:n])
            # Layer 0's input_layernorm has no allreduce before it: a local norm.
            self.h[:n].copy_(rmsnorm(self.residual[:n], self.gammas[0], self.cfg.eps))
            self.attention(0, pos, B, T)
        elif i == self.sites:
            self.lm_head(B, T)
        elif i % 2 == 1:
            self.mlp((i - 1) // 2, n)
        else:
            self.attention(i // 2, pos, B, T)

    def attention(self, layer: int, pos: torch.Tensor, B: int, T: int):
        n, hd, hl, kvl = B * T, self.cfg.head_dim, self.hl, self.kvl
        W = self.w.layers[layer]
        qkv = torch.mm(self.h[:n], W.wqkv_t)
        q, k, v = qkv.split([hl * hd, kvl * hd, kvl * hd], dim=1)
        q = q.reshape(B, T, hl, hd).transpose(1, 2)
        k = k.reshape(B, T, kvl, hd).transpose(1, 2)
        v = v.reshape(B, T, kvl, hd).transpose(1, 2)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        self.k_cache[layer].index_copy_(2, pos, k.contiguous())
        self.v_cache[layer].index_copy_(2, pos, v.contiguous())
        S, group = self.cfg.max_seq, hl // kvl
        kk = self.k_cache[layer][:, :, None].expand(B, kvl, group, S, hd).reshape(B, hl, S, hd)
        vv = self.v_cache[layer][:, :, None].expand(B, kvl, group, S, hd).reshape(B, hl, S, hd)
        mask = self.key_pos[None, :] <= pos[:, None]  # [T, S]: causal over the cache
        o = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)
        torch.mm(o.transpose(1, 2).reshape(n, hl * hd), W.wo_t, out=self.partial[:n])

    def mlp(self, layer: int, n: int):
        W = self.w.layers[layer]
        gu = torch.mm(self.h[:n], W.wgu_t)
        g, u = gu.split(self.il, dim=1)
        torch.mm(F.silu(g) * u, W.wd_t, out=self.partial[:n])

    def lm_head(self, B: int, T: int):
        last = self.h[:B * T].view(B, T, self.cfg.hidden)[:, T - 1]
        torch.mm(last.float(), self.w.lm_head_t, out=self.logits_out)
        torch.argmax(self.logits_out, dim=-1, out=self.next_tok)
