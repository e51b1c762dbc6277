"""The PyTorch side of `python -m jaxdp.bench gpt --vs-torch`: `jaxdp.models.builtin.GPT` written the
nanoGPT way, and its train step (AdamW, bf16 autocast, torch.compile). Imported only when
--vs-torch is given: torch is a benchmark-only extra (`pip install -e '.[bench]'`).

The model is layer for layer the Flax one, so the parameter count is the same (gpt.py checks):
token + learned position embeddings; per block LayerNorm -> one qkv Linear whose output is read
as (3, heads, head_dim) -> causal scaled_dot_product_attention -> output Linear, residual;
LayerNorm -> Linear 4x -> GELU (tanh approximation, flax's default) -> Linear, residual; a final
LayerNorm and an untied head to the vocabulary. Linear layers have biases (flax Dense) and
LayerNorms a scale, a bias and eps 1e-6 (flax's default, torch's is 1e-5). The initialisation is
nanoGPT's (normal 0.02), not flax's: it changes no shape and no FLOP.

Precision, as on the JAX side (parameters float32, --dtype is the compute dtype): bfloat16 runs
the model under `torch.autocast(<device>, dtype=torch.bfloat16)`, on the CPU too, where the JAX
side computes in bfloat16 as well; float32 runs no autocast and lets float32 matmuls use TF32 on
CUDA, as XLA's default precision does on the GPU. The loss is float32 on both sides.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LN_EPS = 1e-6  # flax.linen.LayerNorm's default (torch's is 1e-5)
LR = 3e-4  # the JAX side's optax.adamw(3e-4, weight_decay=0.1)
WEIGHT_DECAY = 0.1  # decoupled, on every parameter, as optax.adamw without a mask


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_attn = nn.LayerNorm(d_model, eps=LN_EPS)
        self.qkv = nn.Linear(d_model, 3 * d_model)  # flax DenseGeneral((3, heads, head_dim))
        self.proj = nn.Linear(d_model, d_model)  # flax DenseGeneral(d_model, axis=(-2, -1))
        self.ln_mlp = nn.LayerNorm(d_model, eps=LN_EPS)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln_attn(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (batch, heads, length, head_dim)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(F.gelu(self.fc(self.ln_mlp(x)), approximate="tanh"))


class TorchGPT(nn.Module):
    def __init__(self, vocab_size: int, seq_len: int, layers: int, d_model: int, heads: int):
        super().__init__()
        self.layers, self.d_model, self.seq_len = layers, d_model, seq_len
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(d_model, eps=LN_EPS)
        self.head = nn.Linear(d_model, vocab_size)  # untied from the embedding, as in the Flax model
        for module in self.modules():  # nanoGPT's initialisation
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> float:
        """jaxdp.models.builtin.GPT.flops_per_token's formula: 6 per non-embedding weight, plus attention."""
        n = self.num_params() - self.embed.weight.numel() - self.pos.weight.numel()
        return 6 * n + 12 * self.layers * self.d_model * self.seq_len


@dataclass
class TorchCase:
    """One batch size's timed case: `run(steps)` runs that many train steps and synchronises."""

    run: Callable[[int], None]
    params: int
    flops_per_token: float
    compiled: bool  # False: eager, by --no-compile or after torch.compile failed on the CPU
    note: str | None  # why it is not compiled, when it is not
    first_step_s: float  # the first step, compilation included


class TorchGPTBench:
    """The model and optimizer, built once; `case(tokens)` gives one batch size's timed case."""

    def __init__(self, *, vocab_size: int, seq_len: int, layers: int, d_model: int, heads: int,
                 dtype: str, device: str, compile: bool):
        torch.manual_seed(0)
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:  # float32 matmuls in TF32, as XLA's default precision on the GPU (bf16 is unaffected)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.model = TorchGPT(vocab_size, seq_len, layers, d_model, heads).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                           fused=True if self.cuda else None)  # fused kernels need CUDA
        self.autocast = dtype == "bfloat16"
        self.note = None if compile else "not compiled (--no-compile)"
        # One graph per batch size (static shapes), as XLA compiles one program per batch size.
        self.forward = torch.compile(self.model, dynamic=False) if compile else self.model

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.forward(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())  # float32, as optax's
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()  # a timed case ends when the device is done, not when it is queued

    def case(self, tokens: list[np.ndarray]) -> TorchCase:
        """Batches from the same token arrays as the JAX side ((batch, seq_len + 1) each); runs
        one step now, which compiles. On the CPU a failing torch.compile falls back to eager and
        says so in `note`; on CUDA it raises."""
        batches = [(torch.from_numpy(t[:, :-1]).long().to(self.device), torch.from_numpy(t[:, 1:]).long().to(self.device))
                   for t in tokens]
        start = time.perf_counter()
        try:
            self._step(*batches[0])
        except Exception as e:  # noqa: BLE001 - inductor raises many kinds; only the CPU falls back
            if self.cuda or self.forward is self.model:
                raise
            self.note = f"torch.compile failed, ran eager: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.forward = self.model
            self.optimizer.zero_grad(set_to_none=True)
            self._step(*batches[0])
        self._sync()
        first_step_s = time.perf_counter() - start

        def run(steps: int) -> None:
            for i in range(steps):
                self._step(*batches[i % len(batches)])
            self._sync()

        return TorchCase(run, self.model.num_params(), self.model.flops_per_token(), self.forward is not self.model,
                         self.note, first_step_s)


def device_for(platform: str) -> str:
    """The torch device that matches JAX's platform: both sides must run on the same device."""
    if platform == "gpu":
        if not torch.cuda.is_available():
            raise SystemExit("jaxdp.bench: JAX runs on the GPU but this torch has no CUDA; install a CUDA build of torch")
        return "cuda"
    if platform != "cpu":
        raise SystemExit(f"jaxdp.bench: --vs-torch runs on CPU or CUDA GPUs, not on JAX's {platform!r} platform")
    return "cpu"

