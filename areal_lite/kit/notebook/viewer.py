"""The trajectory viewer: a batch's rows as coloured segments (prompt, generated, observation) in HTML or text.

Design decisions: segments and turns are derived from `loss_mask` runs, so the viewer works on any batch,
including ones loaded from disk or produced by AReaL. Tokens are decoded one at a time; a character split across
tokens shows as U+FFFD in the HTML view (the plain-text view decodes whole segments and has no such artefact).
"""

from __future__ import annotations

import html
from typing import Dict, List, Optional

import torch

from areal_lite.utils.trajectory import Segment

__all__ = ["trajectory_segments", "trajectory_to_text", "trajectory_to_html", "show_trajectory"]


def trajectory_segments(batch: Dict[str, torch.Tensor], i: int) -> List[Segment]:
    """Segments of row i derived from its loss_mask: the first run is the prompt, then outputs and observations."""
    n = int(batch["attention_mask"][i].sum())
    lm = batch["loss_mask"][i, :n].long().tolist()
    segments: List[Segment] = []
    turn = -1
    start = 0
    for t in range(1, n + 1):
        if t == n or lm[t] != lm[start]:
            if lm[start] == 1:
                turn += 1
                kind = "output"
            else:
                kind = "prompt" if start == 0 else "observation"
            segments.append(Segment(kind, start, t, max(turn, 0)))
            start = t
    return segments


def _row_info(batch, i: int) -> str:
    parts = []
    if "rewards" in batch:
        parts.append(f"reward {float(batch['rewards'][i]):.4f}")
    n = int(batch["attention_mask"][i].sum())
    gen = int(batch["loss_mask"][i, :n].long().sum())
    parts.append(f"{n} tokens ({gen} generated)")
    return " | ".join(parts)


def trajectory_to_text(batch: Dict[str, torch.Tensor], i: int, tokenizer, max_tokens: Optional[int] = None) -> str:
    """A readable dump of row i: `[prompt]`, `[gen turn k | ...]`, `[obs]` blocks, then the reward."""
    n = int(batch["attention_mask"][i].sum())
    ids = batch["input_ids"][i].tolist()
    lp = batch["logprobs"][i].tolist()
    ver = batch["versions"][i].tolist()
    lines = [f"=== trajectory {i} | {_row_info(batch, i)} ==="]
    shown = 0
    for seg in trajectory_segments(batch, i):
        end = seg.end
        if max_tokens is not None:
            end = min(end, seg.start + max(max_tokens - shown, 0))
        if end <= seg.start and seg.end > seg.start:
            lines.append(f"... ({n - seg.start} more tokens)")
            break
        text = tokenizer.decode(ids[seg.start : end], skip_special_tokens=False)
        if seg.generated:
            vs = sorted(set(ver[seg.start : seg.end]))
            mean_lp = sum(lp[seg.start : seg.end]) / max(seg.end - seg.start, 1)
            head = f"[gen turn {seg.turn} | {seg.end - seg.start} tokens | versions {vs} | mean logprob {mean_lp:.3f}]"
            if "token_returns" in batch:
                head = head[:-1] + f" | return {float(batch['token_returns'][i, seg.start]):.4f}]"
        else:
            head = f"[{'prompt' if seg.kind == 'prompt' else 'obs'} | {seg.end - seg.start} tokens]"
        lines.append(head)
        lines.append(text)
        shown += end - seg.start
        if end < seg.end:
            lines.append(f"... ({n - end} more tokens)")
            break
    if "rewards" in batch:
        lines.append(f"[reward] {float(batch['rewards'][i]):.4f}")
    return "\n".join(lines)


_COLOURS = {"prompt": "#e8eef7", "output": "#c9f2c7", "observation": "#fde2c4"}


_LABELS = {"prompt": "prompt", "output": "generated (loss 1)", "observation": "tool / feedback (loss 0)"}


def _colour_kind(kind: str) -> str:
    """The kind a segment is coloured as: every kind but prompt and output is an observation."""
    return kind if kind in _COLOURS else "observation"


def _legend(kinds: set) -> str:
    """The colour key of the kinds a row shows, and only those (a single-turn row has no tool or feedback tokens)."""
    shown = {_colour_kind(k) for k in kinds}
    entries = [f'<span style="background:{_COLOURS[k]}">{label}</span>' for k, label in _LABELS.items() if k in shown]
    return " ".join(entries)


def trajectory_to_html(batch: Dict[str, torch.Tensor], i: int, tokenizer, max_tokens: Optional[int] = None) -> str:
    """HTML for row i: one span per token, coloured by kind, with id/logprob/version in the hover title."""
    n = int(batch["attention_mask"][i].sum())
    ids = batch["input_ids"][i].tolist()
    lp = batch["logprobs"][i].tolist()
    ver = batch["versions"][i].tolist()
    tr = batch["token_returns"][i].tolist() if "token_returns" in batch else None
    limit = n if max_tokens is None else min(n, max_tokens)
    segments = [seg for seg in trajectory_segments(batch, i) if seg.start < limit]
    parts = [
        '<div class="areal-trajectory" style="font-family:monospace;font-size:12px;line-height:1.6">',
        f"<div><b>trajectory {i}</b> | {html.escape(_row_info(batch, i))}</div>",
        f"<div>{_legend({seg.kind for seg in segments})}</div>",
        '<div style="white-space:pre-wrap;border:1px solid #ccc;padding:4px">',
    ]
    for seg in segments:
        colour = _COLOURS[_colour_kind(seg.kind)]
        if seg.generated:
            ret = f", return {tr[seg.start]:.4f}" if tr is not None else ""
            parts.append(
                f'<span style="color:#fff;background:#555;font-size:10px" title="turn boundary">'
                f"&#9656; turn {seg.turn}{ret}</span>"
            )
        for t in range(seg.start, min(seg.end, limit)):
            text = tokenizer.decode([ids[t]], skip_special_tokens=False)
            if seg.generated:
                title = f"turn {seg.turn} | id {ids[t]} | logprob {lp[t]:.4f} | version {ver[t]}"
            else:
                title = f"{seg.kind} | id {ids[t]}"
            parts.append(
                f'<span style="background:{colour}" title="{html.escape(title, quote=True)}">'
                f"{html.escape(text, quote=True)}</span>"
            )
    if limit < n:
        parts.append(f"<i> ... ({n - limit} more tokens)</i>")
    parts.append("</div>")
    if "rewards" in batch:
        parts.append(f"<div><b>reward</b> {float(batch['rewards'][i]):.4f}</div>")
    parts.append("</div>")
    return "".join(parts)


def _in_jupyter() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def show_trajectory(
    batch: Dict[str, torch.Tensor], i: int, tokenizer, max_tokens: Optional[int] = None, fmt: str = "auto"
) -> None:
    """Display row i: coloured HTML in a Jupyter kernel, plain text elsewhere (`fmt`: "auto" | "html" | "text")."""
    if fmt not in ("auto", "html", "text"):
        raise ValueError(f"fmt must be 'auto', 'html' or 'text', got {fmt!r}")
    if not 0 <= i < batch["input_ids"].shape[0]:
        raise IndexError(f"row {i} out of range for a batch of {batch['input_ids'].shape[0]} rows")
    if fmt == "html" or (fmt == "auto" and _in_jupyter()):
        from IPython.display import display

        # Both forms in one output: a viewer that does not render HTML (a terminal, some notebook previews) shows
        # the text view instead of "<IPython.core.display.HTML object>".
        bundle = {
            "text/html": trajectory_to_html(batch, i, tokenizer, max_tokens),
            "text/plain": trajectory_to_text(batch, i, tokenizer, max_tokens),
        }
        display(bundle, raw=True)
    else:
        print(trajectory_to_text(batch, i, tokenizer, max_tokens))
