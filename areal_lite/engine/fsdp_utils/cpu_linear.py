"""The CPU trainer's LM head: its forward product on oneDNN where this CPU runs it faster than MKL.

Design decisions, and why
- A float32 `nn.Linear` on a CPU runs MKL's sgemm. For the LM head's shape (a few hundred rows against the whole
  vocabulary) oneDNN's matmul, the server's kernel, ran 1.2-1.6x as fast on the CPUs measured (an AVX-512 EPYC, and
  the same CPU on its AVX2 kernels): a few percent of a small model's update. `head_speedup` measures it, once per
  process, on one thread by CPU time (`device.speedup_on_one_thread`), and oneDNN takes it only at `MIN_SPEEDUP`
  or more: the choice changes the float rounding, and the margin keeps a CPU on the same side run after run, so a
  seeded run repeats itself.
- Only the head's forward. The gradients stay on MKL, and so do the decoder layers: there oneDNN measured from a
  little slower to a little faster, too close to a margin for a choice that must not change between runs.
- Only a bias-free float32 head outside autocast takes the path; anything else runs `nn.Linear`'s own forward.
- bench/update_speed.py times the whole update.
"""

from __future__ import annotations

import functools
import types
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["MIN_SPEEDUP", "head_speedup", "use_onednn_head"]

MIN_SPEEDUP = 1.1
ROWS = 16  # rows of the measured product: a tenth of a second on one thread for SmolLM2's head


def _onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w [out, in]^T on oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


@functools.lru_cache(maxsize=None)
def head_speedup(n_out: int, n_in: int) -> float:
    """How many times as fast oneDNN runs an [n_out, n_in] head's forward as MKL, here (once per process and shape,
    so that every actor of a process agrees); 0 without oneDNN, or where its build cannot run this product (a CPU
    or build not measured here, such as an Arm one, then keeps MKL instead of failing at start-up)."""
    from areal_lite.utils.device import speedup_on_one_thread

    if not torch.backends.mkldnn.is_available():
        return 0.0
    g = torch.Generator().manual_seed(0)  # its own generator: the caller's random stream is left as it was
    w = torch.randn(n_out, n_in, generator=g)
    x = torch.randn(ROWS, n_in, generator=g)
    try:
        return speedup_on_one_thread(lambda: F.linear(x, w), lambda: _onednn(x, w))
    except (RuntimeError, NotImplementedError):
        return 0.0


class _OneDNNForward(torch.autograd.Function):
    """y = x w^T, the product on oneDNN; its gradients as `F.linear`'s (on MKL)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        return _onednn(x.reshape(-1, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, w = ctx.saved_tensors
        g = gy.reshape(-1, gy.shape[-1])  # [N, out]
        gx = g.mm(w).view(x.shape) if ctx.needs_input_grad[0] else None  # [N, in]
        gw = g.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None  # [out, in]
        return gx, gw


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype != torch.float32 or self.weight.dtype != torch.float32 or torch.is_autocast_enabled("cpu"):
        return torch.nn.Linear.forward(self, x)
    return _OneDNNForward.apply(x, self.weight)


def use_onednn_head(model: torch.nn.Module) -> Optional[float]:
    """Run `model`'s LM head forward on oneDNN where `head_speedup` measures it at least `MIN_SPEEDUP` times as
    fast. Returns the speed-up measured, or None for a head this does not apply to."""
    head = model.get_output_embeddings()
    if type(head) is not torch.nn.Linear or head.bias is not None or head.weight.device.type != "cpu":
        return None
    speedup = head_speedup(*head.weight.shape)
    if speedup >= MIN_SPEEDUP:
        head.forward = types.MethodType(_forward, head)
    return speedup
