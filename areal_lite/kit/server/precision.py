"""`--dtype auto`: the precision the server picks for this machine, bfloat16 only where it is faster and still exact.

Design decisions
- Measured at start-up, never assumed: having bf16 instructions (AMX, AVX-512 BF16) does not make a CPU's bf16 matmuls
  faster, and oneDNN's bf16 kernels may give a row other bits when other rows share its batch (they switch blocking with
  the row count). On the model's own MLP shapes, `auto` times both dtypes' packed matmuls at a decode step's
  `DECODE_ROWS` rows (one thread's CPU clock: the trainer may be starting beside the server), and checks that batches of
  2 to 2 x `BF16_ROWS` + 1 rows, and of 100, give each row the bits it gets alone, through the server's own
  `fastpath._Linear` (bf16 runs `BF16_ROWS` rows at a time). bfloat16 only where it is `BF16_MIN_SPEEDUP` times as fast
  and exact; float32 otherwise (what the trainer computes, so never wrong).
- A GPU serves bfloat16 (as SGLang does); Apple's MPS float32.
- bf16 weights sample from a slightly different policy than the float32 trainer's; the PPO ratio
  exp(trainer log-prob - server log-prob) and its clipping absorb it, as with AReaL's bf16 SGLang servers.
  bench/rollout_throughput.py --dtype measures the server in each dtype.
"""

from __future__ import annotations

import torch

# A decode step of the demo's batch (max_running_requests).
DECODE_ROWS = 32

__all__ = ["DECODE_ROWS", "serving_dtype"]


def serving_dtype(device: torch.device, hidden: int, intermediate: int) -> tuple[torch.dtype, str]:
    """(the dtype `--dtype auto` serves on `device`, the reason, for the log) for a model of MLP sizes
    `hidden` -> `intermediate`. On a CPU: see the module docstring."""
    if device.type == "cuda":
        return torch.bfloat16, "a GPU serves bfloat16"
    if device.type != "cpu":
        return torch.float32, f"float32 on {device.type}"
    from areal_lite.kit.server.fastpath import packs_weights, probe_linears, rows_exact
    from areal_lite.utils.device import BF16_MIN_SPEEDUP, cpu_native_bf16

    native = cpu_native_bf16()
    if not native or not packs_weights(torch.bfloat16):
        return torch.float32, f"this CPU ({torch.backends.cpu.get_cpu_capability()}) has no AVX-512 BF16/AMX"
    bf16 = probe_linears(hidden, intermediate, torch.bfloat16)  # one packing for both checks below
    speedup = _decode_speedup(probe_linears(hidden, intermediate, torch.float32), bf16)
    measured = f"a decode step's matmuls ran {speedup:.2f}x as fast in bf16 as in float32"
    if speedup < BF16_MIN_SPEEDUP:
        return torch.float32, f"this CPU has {native}, but {measured}"
    if not rows_exact(bf16):
        return torch.float32, f"this CPU has {native} and {measured}, but its bf16 rows change with the batch"
    return torch.bfloat16, f"this CPU has {native}; {measured}, rows exact at any batch"


@torch.inference_mode()
def _decode_speedup(fp32: list, bf16: list, calls: int = 5) -> float:
    """How many times as fast the two MLP matmuls (`fastpath.probe_linears`) run at `DECODE_ROWS` rows in bf16 as in
    float32 (`utils.device.speedup_on_one_thread`)."""
    from areal_lite.utils.device import speedup_on_one_thread

    def side(linears: list):
        up, down = linears
        hidden, intermediate = up.weight.shape[1], down.weight.shape[1]
        x = torch.randn(DECODE_ROWS, hidden).to(up.weight.dtype)

        def run() -> None:
            for _ in range(calls):
                down(up(x)[:, :intermediate])

        return run

    return speedup_on_one_thread(side(fp32), side(bf16))
