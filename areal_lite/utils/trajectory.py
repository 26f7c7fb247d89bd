"""The tensor contract of one episode, the builder that keeps it and the checker that proves it.

The contract (what every workflow returns and the actor consumes): a plain `dict[str, torch.Tensor]` with AReaL
1.0.4's keys and dtypes (so a batch moves between the two unchanged). Per-token keys are `[B, L]`, right-padded:
    `input_ids`      int32  the whole trajectory: prompt, then generated tokens and observations in order
    `attention_mask` bool   True on real tokens; a prefix of ones in every row (padding only on the right)
    `loss_mask`      int32  1 exactly on tokens the policy generated; 0 on prompt, tool/feedback tokens, padding
    `logprobs`       float32 behaviour log-prob of each generated token (<= 0), 0.0 elsewhere
    `versions`       int32  policy version that produced each generated token (>= 0), -1 on prompt and
                            observations; padding holds `pad_value` (0), as AReaL pads every key
Per-row keys are `[B]`: `rewards` (float32) always. Extra per-token keys are allowed, e.g. `token_returns`. Not
shifted: position t holds token t's own logprob and version. A group of G samples of one prompt is G contiguous rows.

Design decisions:
- `TrajectoryBuilder` is the only place a workflow appends tokens: every append extends all per-token lists
  together, and a response generated from another context than the one it holds is refused.
- Padding carries no meaning: consumers look only where `attention_mask` is True. `check_trajectory` accepts int32
  or int64 ids/masks/versions and bool masks, so batches made by AReaL pass.
- `check_trajectory` raises `TrajectoryError` (an AssertionError) listing every violation with its key, row and
  position; a row with no generated token fails unless `allow_all_prompt=True` (it means a broken workflow).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence

import torch

__all__ = [
    "TOKEN_KEYS",
    "TrajectoryError",
    "check_trajectory",
    "misshapen_keys",
    "Segment",
    "TrajectoryBuilder",
    "iter_rows",
]


_INT_DTYPES = (torch.int32, torch.long)


TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions")


class TrajectoryError(AssertionError):
    """A batch breaks the tensor contract (the message names the key, row and position)."""


class _Problems(list):
    """The checks append every violation they find; `check_trajectory` raises once with all of them."""

    def __call__(self, msg: str) -> None:
        self.append(msg)


def _first_bad(mask: torch.Tensor):
    """(row, position) of the first True in a 2-D bool tensor."""
    idx = mask.nonzero()
    return int(idx[0, 0]), int(idx[0, 1])


def misshapen_keys(tensors: Dict[str, torch.Tensor]) -> Dict[str, tuple]:
    """Keys whose shape disagrees with a 2-D `input_ids` [B, L]: per-token keys not [B, L, ...], per-row keys not
    [B]. The executor refuses such an episode with it; `check_trajectory` reports the same keys."""
    B, L = tensors["input_ids"].shape
    return {
        k: tuple(v.shape)
        for k, v in tensors.items()
        if (v.dim() >= 2 and tuple(v.shape[:2]) != (B, L)) or (v.dim() == 1 and v.shape[0] != B)
    }


def _check_shapes(batch: Dict[str, torch.Tensor], fail: _Problems) -> None:
    """Required keys are there, are tensors, and agree on [B, L] (token keys) or [B] (per-row keys)."""
    if not isinstance(batch, dict):
        return fail(f"a batch is a dict of tensors, got {type(batch).__name__}")
    required = TOKEN_KEYS + ("rewards",)
    missing = [k for k in required if k not in batch]
    if missing:
        hint = " (found 'reward': the key is 'rewards')" if "reward" in batch and "rewards" in missing else ""
        fail(f"batch is missing keys {missing}{hint}")
    for k, v in batch.items():
        if not isinstance(v, torch.Tensor):
            fail(f"{k!r} is {type(v).__name__}, not a torch.Tensor")
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    ids = tensors.get("input_ids")
    if ids is None:
        return None
    if ids.dim() != 2:
        return fail(f"input_ids must be [B, L], got shape {tuple(ids.shape)}")
    B, L = ids.shape
    for k, shape in misshapen_keys(tensors).items():
        want = f"[{B}, {L}] like input_ids" if len(shape) >= 2 else f"[{B}] (one value per row)"
        fail(f"{k!r} has shape {shape}, expected {want}")
    for k, v in tensors.items():
        if v.dim() == 0:
            fail(f"{k!r} is a 0-d tensor; per-row keys are [B] (use rewards=torch.tensor([r]))")
    for k in TOKEN_KEYS:
        if k in tensors and tensors[k].dim() != 2:
            fail(f"{k!r} must be [B, L], got shape {tuple(batch[k].shape)}")


def _check_dtypes(batch: Dict[str, torch.Tensor], fail: _Problems) -> None:
    """Dtypes AReaL's trainer accepts; finite rewards."""
    ids = batch["input_ids"]
    att, lm, lp, ver, rew = (batch[k] for k in ("attention_mask", "loss_mask", "logprobs", "versions", "rewards"))
    if ids.dtype not in _INT_DTYPES:
        fail(f"input_ids dtype is {ids.dtype}, expected torch.int32 (AReaL's) or torch.long")
    if att.dtype != torch.bool:
        fail(f"attention_mask dtype is {att.dtype}, expected torch.bool")
    if lm.dtype not in (torch.bool, torch.int8, torch.int16, torch.int32, torch.long, torch.uint8):
        fail(f"loss_mask dtype is {lm.dtype}, expected an integer or bool dtype")
    if not lp.is_floating_point():
        fail(f"logprobs dtype is {lp.dtype}, expected a float dtype")
    if ver.dtype not in _INT_DTYPES:
        fail(f"versions dtype is {ver.dtype}, expected torch.int32 (AReaL's) or torch.long")
    if rew.dim() != 1 or not rew.is_floating_point():
        fail(f"rewards must be a float [B] tensor, got dtype {rew.dtype} shape {tuple(rew.shape)}")
    if not torch.isfinite(rew).all():
        fail(f"rewards has non-finite values at rows {(~torch.isfinite(rew)).nonzero().flatten().tolist()}")


def _check_values(batch: Dict[str, torch.Tensor], allow_all_prompt: bool, fail: _Problems) -> None:
    """Masks are 0/1 and right-padded; prompt/observation tokens carry logprob 0 and version -1."""
    ids, att, lm, lp, ver = (batch[k] for k in ("input_ids", "attention_mask", "loss_mask", "logprobs", "versions"))
    B, L = ids.shape
    lm_int = lm.long()
    if ((lm_int != 0) & (lm_int != 1)).any():
        r, t = _first_bad((lm_int != 0) & (lm_int != 1))
        fail(f"loss_mask must be 0/1; row {r} position {t} holds {int(lm_int[r, t])}")
    gen = lm_int == 1
    if (gen & ~att).any():
        r, t = _first_bad(gen & ~att)
        fail(f"loss_mask is 1 outside attention_mask at row {r} position {t}")
    if B and L:
        # Right padding: once attention_mask turns False it stays False.
        starts_pad = att[:, :-1] < att[:, 1:] if L > 1 else torch.zeros(B, 0, dtype=torch.bool)
        if starts_pad.any():
            r, t = _first_bad(starts_pad)
            fail(f"attention_mask of row {r} is not a prefix of ones: False at {t}, True at {t + 1} (left padding?)")
    real_not_gen = att & ~gen  # prompt and observations; padding may hold anything (AReaL pads with 0)
    if (real_not_gen & (lp != 0)).any():
        r, t = _first_bad(real_not_gen & (lp != 0))
        fail(f"logprobs must be 0 where loss_mask is 0; row {r} position {t} holds {float(lp[r, t]):.4f}")
    if (real_not_gen & (ver != -1)).any():
        r, t = _first_bad(real_not_gen & (ver != -1))
        fail(f"versions must be -1 on prompt and observation tokens; row {r} position {t} holds {int(ver[r, t])}")
    if (gen & (ver < 0)).any():
        r, t = _first_bad(gen & (ver < 0))
        fail(f"versions must be >= 0 on generated tokens; row {r} position {t} holds {int(ver[r, t])}")
    bad_lp = gen & ~(torch.isfinite(lp) & (lp <= 1e-4))
    if bad_lp.any():
        r, t = _first_bad(bad_lp)
        fail(f"logprobs on generated tokens must be finite and <= 0; row {r} position {t} holds {float(lp[r, t])}")
    if (att & (ids < 0)).any():
        r, t = _first_bad(att & (ids < 0))
        fail(f"input_ids must be >= 0; row {r} position {t} holds {int(ids[r, t])}")
    if "token_returns" in batch:
        tr = batch["token_returns"]
        if tr.dim() != 2 or not tr.is_floating_point():
            fail(f"token_returns must be a float [B, L] tensor, got dtype {tr.dtype} shape {tuple(tr.shape)}")
        if (real_not_gen & (tr != 0)).any():
            r, t = _first_bad(real_not_gen & (tr != 0))
            fail(f"token_returns must be 0 where loss_mask is 0; row {r} position {t} holds {float(tr[r, t])}")
    if not allow_all_prompt:
        empty = (~gen.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            fail(f"rows {empty} have no generated token (loss_mask all 0); pass allow_all_prompt=True if intended")


def _check_texts(batch: Dict[str, torch.Tensor], tokenizer, expected_texts, fail: _Problems) -> None:
    """The decoded real tokens of each row equal the concatenation of its expected segments."""
    ids, att = batch["input_ids"], batch["attention_mask"]
    B = ids.shape[0]
    if tokenizer is None:
        return fail("expected_texts needs a tokenizer to decode input_ids")
    if len(expected_texts) != B:
        return fail(f"expected_texts has {len(expected_texts)} rows, batch has {B}")
    for r in range(B):
        n = int(att[r].sum())
        got = tokenizer.decode(ids[r, :n].tolist(), skip_special_tokens=False)
        want = "".join(expected_texts[r])
        if got != want:
            at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            fail(
                f"row {r}: decoded text differs from the expected segments at character {at}: "
                f"got {got[max(0, at - 30) : at + 30]!r}, expected {want[max(0, at - 30) : at + 30]!r}"
            )


def check_trajectory(
    batch: Dict[str, torch.Tensor],
    tokenizer=None,
    expected_texts: Optional[Sequence[Sequence[str]]] = None,
    allow_all_prompt: bool = False,
) -> bool:
    """Assert the tensor contract on `batch`; return True or raise `TrajectoryError` listing every violation.

    Keys, shapes and dtypes are all checked and reported together; the values are checked (and the decoded texts
    compared) once those hold, since a value check on a wrong shape would only repeat the shape problem.
    With `tokenizer` and `expected_texts` (one list of segment strings per row: prompt, outputs, observations in
    order), the decoded real tokens of each row must equal the concatenation of its segments.
    """
    problems = _Problems()
    _check_shapes(batch, problems)
    if not problems:
        _check_dtypes(batch, problems)
    if not problems:
        _check_values(batch, allow_all_prompt, problems)
    if not problems and expected_texts is not None:
        _check_texts(batch, tokenizer, expected_texts, problems)
    if len(problems) == 1:
        raise TrajectoryError(problems[0])
    if problems:
        raise TrajectoryError(f"{len(problems)} problems:\n" + "\n".join(f"- {p}" for p in problems))
    return True


@dataclass(frozen=True)
class Segment:
    """A run of tokens `[start, end)` of one kind: "prompt", "output" (generated) or an observation kind."""

    kind: str
    start: int
    end: int
    turn: int  # index of the generation this segment belongs to or follows (prompt: 0)

    @property
    def generated(self) -> bool:
        return self.kind == "output"


class TrajectoryBuilder:
    """Accumulates one trajectory so that all per-token lists grow together.

    ```
    b = TrajectoryBuilder(); b.add_prompt(prompt_ids)
    resp = await engine.agenerate(ModelRequest(input_ids=b.context(), ...)); b.add_output(resp)
    b.add_observation(tool_ids, kind="tool")
    batch = b.to_tensors(reward)          # [1, L] tensors + rewards [1]
    ```
    """

    def __init__(self) -> None:
        self.input_ids: List[int] = []
        self.logprobs: List[float] = []
        self.loss_mask: List[int] = []
        self.versions: List[int] = []
        self.segments: List[Segment] = []
        self.num_turns = 0  # number of outputs added so far

    def __len__(self) -> int:
        return len(self.input_ids)

    def context(self) -> List[int]:
        """A copy of the token ids so far: the next request's `input_ids`."""
        return list(self.input_ids)

    def _append(self, ids: Sequence[int], logprobs, versions, loss: int, kind: str, turn: int) -> None:
        ids = [int(t) for t in ids]
        start = len(self.input_ids)
        self.input_ids.extend(ids)
        self.logprobs.extend(float(x) for x in logprobs)
        self.loss_mask.extend([loss] * len(ids))
        self.versions.extend(int(v) for v in versions)
        self.segments.append(Segment(kind, start, len(self.input_ids), turn))

    def add_prompt(self, ids: Sequence[int]) -> "TrajectoryBuilder":
        """The initial prompt (loss 0). Must come first, once."""
        if self.input_ids:
            raise ValueError("add_prompt must be the first call (the trajectory already has tokens)")
        ids = list(ids)
        self._append(ids, [0.0] * len(ids), [-1] * len(ids), 0, "prompt", 0)
        return self

    def add_output(self, resp) -> "TrajectoryBuilder":
        """A `ModelResponse`'s generated tokens with their logprobs and versions (loss 1)."""
        out, lps = list(resp.output_tokens), list(resp.output_logprobs)
        vers = list(resp.output_versions)
        if len(lps) != len(out):
            raise ValueError(f"response has {len(out)} output tokens but {len(lps)} logprobs")
        if len(vers) != len(out):
            raise ValueError(f"response has {len(out)} output tokens but {len(vers)} versions")
        # The response must continue exactly this trajectory; anything else means tokens were appended
        # somewhere else (or twice), and the training data would not be what was sampled.
        if resp.input_tokens and list(resp.input_tokens) != self.input_ids:
            raise ValueError(
                f"response was generated from a {len(resp.input_tokens)}-token context that differs from the "
                f"{len(self.input_ids)}-token trajectory; pass builder.context() as the request's input_ids"
            )
        self._append(out, lps, vers, 1, "output", self.num_turns)
        self.num_turns += 1
        return self

    def add_observation(self, ids: Sequence[int], kind: str = "observation") -> "TrajectoryBuilder":
        """Tokens the policy did not generate (tool results, feedback, chat-template glue): loss 0."""
        if not self.input_ids:
            raise ValueError("add_prompt must come before add_observation")
        if kind == "output":
            raise ValueError("kind='output' is reserved for add_output (generated tokens)")
        ids = list(ids)
        self._append(ids, [0.0] * len(ids), [-1] * len(ids), 0, kind, max(self.num_turns - 1, 0))
        return self

    def per_turn_values(self, values: Sequence[float]) -> List[float]:
        """A per-token list holding `values[k]` on the generated tokens of turn k and 0.0 elsewhere."""
        if len(values) != self.num_turns:
            raise ValueError(f"need one value per turn: {self.num_turns} turns, got {len(values)} values")
        out = [0.0] * len(self.input_ids)
        for seg in self.segments:
            if seg.generated:
                for t in range(seg.start, seg.end):
                    out[t] = float(values[seg.turn])
        return out

    def to_tensors(self, reward: float, **extra) -> Dict[str, torch.Tensor]:
        """The `[1, L]` tensors of the contract plus `rewards` `[1]`.

        `extra`: per-token lists/tensors of length L become float32 `[1, L]`; scalars become float32 `[1]`.
        """
        n = len(self.input_ids)
        reward = float(reward)
        if not math.isfinite(reward):
            raise ValueError(f"reward must be finite, got {reward}")
        out = {
            "input_ids": torch.tensor([self.input_ids], dtype=torch.int32),
            "attention_mask": torch.ones(1, n, dtype=torch.bool),
            "loss_mask": torch.tensor([self.loss_mask], dtype=torch.int32),
            "logprobs": torch.tensor([self.logprobs], dtype=torch.float32),
            "versions": torch.tensor([self.versions], dtype=torch.int32),
            "rewards": torch.tensor([reward], dtype=torch.float32),
        }
        for key, value in extra.items():
            if key in out:
                raise ValueError(f"extra key {key!r} clashes with a contract key")
            t = torch.as_tensor(value, dtype=torch.float32)
            if t.dim() == 0:
                out[key] = t.reshape(1)
            elif t.dim() == 1 and t.shape[0] == n:
                out[key] = t.reshape(1, n)
            else:
                raise ValueError(f"extra key {key!r}: expected a scalar or {n} per-token values, got {tuple(t.shape)}")
        return out


def iter_rows(batch: Dict[str, torch.Tensor]) -> Iterable[Dict[str, torch.Tensor]]:
    """Each row of a batch as its own `[1, L_i]` dict, padding removed (handy for inspection)."""
    B = batch["input_ids"].shape[0]
    for r in range(B):
        n = int(batch["attention_mask"][r].sum())
        yield {k: (v[r : r + 1, :n] if v.dim() >= 2 else v[r : r + 1]) for k, v in batch.items()}
