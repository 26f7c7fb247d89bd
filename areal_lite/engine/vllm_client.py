"""The HTTP client of vLLM servers: `SGLangClient`'s method set and behaviour, spoken in vLLM's protocol.

`RemotevLLMEngine` uses it, and so does `RemoteSGLangEngine` when its servers turn out to be vLLM (`is_vllm`), so a
notebook runs unchanged with `AREAL_LITE_OVERRIDES="backend=vllm"`. Retries, rid routing, interrupt and resume,
versions and shutdown are `SGLangClient`'s; this class replaces only the calls that differ. `launch_server(...,
backend="vllm")` starts the server with `VLLM_SERVER_DEV_MODE=1` and the kit's worker extension.

| what | SGLang-compatible server | vLLM 0.32 |
| --- | --- | --- |
| generate | `/generate`, `input_ids` | `/v1/completions`, `prompt` as ids, `return_token_ids`, `logprobs: 0` |
| pause (abort) / resume | `/pause_generation` (abort), `/continue_generation` | `/pause?mode=abort`, `/resume` |
| abort one request | `/abort_request {"rid": rid}` | `/abort_requests {"request_ids": ["cmpl-<rid>-0"]}` |
| disk weight update | `/update_weights_from_disk` | `/collective_rpc` (kit's extension), `/reset_prefix_cache` |
| LoRA adapter | `/load_lora_adapter`; a request's `lora_path` | `/v1/load_lora_adapter`; a request's `model` |

Design decisions
- Logprobs after temperature, as SGLang and the trainer compute them (`VLLMClient`); token ids in and out, special
  tokens and matched stop strings kept (`completion_body`).
- Updates from disk only (NCCL raises): full weights reload every worker and reset the prefix cache, never mixing
  two versions (`load_from_disk`); a LoRA adapter loads beside them by versioned name (needs `vllm.enable_lora`).
"""

from __future__ import annotations

import asyncio
from typing import Any, List

import aiohttp

from areal_lite.api.io_struct import WeightUpdateMeta
from areal_lite.infra.remote_inf_engine import EngineError, SGLangClient, sampling_params

__all__ = ["VLLMClient", "completion_body", "parse_completion", "is_vllm", "RELOAD_METHOD"]

# The method of the kit's worker extension (kit/server/vllm_ext, passed by the launcher) that reloads weights.
RELOAD_METHOD = "areal_lite_reload_weights"
_RESET_TRIES, _RESET_PAUSE = 50, 0.1  # /reset_prefix_cache refused while blocks are held: retry for ~5 s


def completion_body(g: Any, input_ids: List[int], max_new_tokens: int, min_new_tokens: int, rid: str) -> dict:
    """The `/v1/completions` body of one chunk: the same sampling as SGLang's (`remote_inf_engine.sampling_params`),
    in vLLM's flat field names. Stop strings included: AReaL 1.0.4's `RemotevLLMEngine` leaves them out.

    Special tokens are kept, and a matched stop string stays in the output: vLLM, like SGLang with `no_stop_trim`,
    reports the token ids it sampled, and `include_stop_str_in_output` keeps the text consistent with them. (The
    launcher's `--generation-config vllm` keeps the model folder's `generation_config.json` from adding sampling
    defaults, a repetition penalty say, that the request did not ask for.)"""
    p = sampling_params(g, max_new_tokens=max_new_tokens)
    body = {
        "prompt": [int(t) for t in input_ids],
        "max_tokens": p["max_new_tokens"],
        "min_tokens": int(min_new_tokens),
        "temperature": p["temperature"],
        "top_p": p["top_p"],
        "top_k": max(0, p["top_k"]),  # vLLM's "all tokens" is 0 (it still accepts SGLang's -1)
        "stop_token_ids": p["stop_token_ids"],
        "ignore_eos": p["ignore_eos"],
        "skip_special_tokens": False,
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's logprob only
        "return_token_ids": True,
        "request_id": rid,
        "n": 1,
        "stream": False,
    }
    for key in ("stop", "frequency_penalty"):
        if key in p:
            body[key] = p[key]
    return body


def parse_completion(result: Any, addr: str) -> tuple:
    """`/v1/completions`' answer -> (tokens, logprobs, finish_reason, message, None) like `_parse_generate`."""
    try:
        choice = result["choices"][0]
        tokens = [int(t) for t in (choice.get("token_ids") or [])]
        lp = choice.get("logprobs") or {}
        logprobs = [float(x) for x in (lp.get("token_logprobs") or [])]
        finish = choice["finish_reason"]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise EngineError(
            f"{addr}/v1/completions answered without choices[0].token_ids/logprobs/finish_reason "
            f"({type(e).__name__}: {e}); body starts {str(result)[:200]!r}",
            address=addr,
        ) from None
    if len(logprobs) != len(tokens):
        raise EngineError(f"{addr}: {len(tokens)} tokens but {len(logprobs)} logprobs (send logprobs: 0)", address=addr)
    return tokens, logprobs, finish, str(choice.get("stop_reason") or ""), None


class VLLMClient(SGLangClient):
    """`SGLangClient` for vLLM servers (see the module docstring); the same methods, flags and threading rules.

    Logprobs: the launcher starts vLLM with `--logprobs-mode processed_logprobs` (`vLLMConfig.logprobs_mode`), the
    log-softmax of the logits after temperature: SGLang's default, the embedded server's, and what the trainer
    recomputes at `actor.temperature`. vLLM's own default, `raw_logprobs`, is taken before temperature (the embedded
    server's `--return-original-logprob`); the two agree at temperature 1 and for greedy decoding. One difference
    remains: with top-k or top-p vLLM's processed logprobs are renormalised over the kept tokens, SGLang's are not.
    Versions: vLLM's completions carry no weight version, so every token gets the engine's version when its chunk
    was sent (exact, since weights only change while requests are paused or drained).
    LoRA: `load_lora` as `SGLangClient`'s, over vLLM's routes (a failed load is a 4xx there, not a 200 with
    `success: false`); requests name the adapter in `model`, vLLM's field for it."""

    LORA_LOAD, LORA_UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"

    @classmethod
    def take_over(cls, other: SGLangClient) -> "VLLMClient":
        """A vLLM client with `other`'s servers and open session, for an engine that found out after connecting
        that its servers are vLLM (nothing has been sent through `other` but health checks)."""
        new = cls(other.config, other._current_version)
        new.addresses, new._session = list(other.addresses), other._session
        new.paused, new.closing = other.paused, other.closing
        return new

    async def generate_once(
        self, addr: str, wire_rid: str, input_ids: List[int], g: Any, max_new_tokens: int, min_new_tokens: int
    ) -> tuple:
        body = completion_body(g, input_ids, max_new_tokens, min_new_tokens, wire_rid)
        if self.config.use_lora:
            body["model"] = self.lora_path(g)  # the adapter by name, as AReaL's vLLM backend asks for it
        return parse_completion(await self.request("POST", addr, "/v1/completions", body), addr)

    async def load_lora(self, path: str, version: int, meta: WeightUpdateMeta) -> None:
        try:
            await super().load_lora(path, version, meta)
        except EngineError as e:
            # A bare "Not Found" is FastAPI's answer for a route the server lacks; vLLM's own 404s name the adapter.
            if e.status != 404 or e.reason != "Not Found":
                raise
            hint = (
                "this vLLM server has no adapter routes: start it with --enable-lora and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (the kit's launcher does both for vllm.enable_lora=true)"
            )
            raise EngineError(f"{e}; {hint}", e.status, e.address, e.reason) from None

    async def abort_all(self) -> None:
        await self.post_all("/pause?mode=abort", {})

    async def continue_all(self) -> None:
        await self.post_all("/resume", {})

    async def _abort_on_server(self, addr: str, rid: str) -> None:
        # One short attempt, no retries (the shutdown path, as SGLangClient's).
        body = {"request_ids": [f"cmpl-{rid}-0"]}  # vLLM's internal id; the bare one silently aborts nothing
        async with self._session.post(
            f"http://{addr}/abort_requests", json=body, timeout=aiohttp.ClientTimeout(total=2.0)
        ) as resp:
            await resp.read()

    def weight_update(self, meta: WeightUpdateMeta, version: int, timeout: float):
        if meta.type != "disk":
            raise NotImplementedError(
                f"the kit's vLLM client updates weights from disk only (WeightUpdateMeta.from_disk), not {meta.type!r}"
            )
        return super().weight_update(meta, version, timeout)

    async def load_from_disk(self, path: str, version: int) -> None:
        """`POST /collective_rpc` runs `areal_lite_reload_weights` in every worker (vLLM's own `reload_weights`
        leaves a tied output layer on the old weights: see the extension's docstring), then `/reset_prefix_cache`:
        without it, a cached prompt prefix keeps the old weights' keys and values. Outside `pause()` the running
        requests finish first (`/pause?mode=wait`, then `/resume`), as SGLang's update does, so no token mixes two
        versions."""
        drain = not self.paused  # outside pause(): let running requests finish on the old weights first
        if drain:
            await self.post_all("/pause?mode=wait", {})
        try:
            answers = await self.post_all("/collective_rpc", {"method": RELOAD_METHOD, "args": [path]})
            for addr, ans in zip(self.addresses, answers):
                if not (isinstance(ans, dict) and ans.get("results")):
                    raise EngineError(f"{addr} did not reload {path}: {str(ans)[:300]}", 200, addr)  # it answered
            await asyncio.gather(*(self._reset_prefix_cache(a) for a in self.addresses))
        finally:
            if drain:
                await self.post_all("/resume", {})

    async def _reset_prefix_cache(self, addr: str) -> None:
        """A reset is refused while requests hold cache blocks: retried for a few seconds."""
        for _ in range(_RESET_TRIES):
            ans = await self.request("POST", addr, "/reset_prefix_cache", {})
            if not isinstance(ans, dict) or ans.get("success", True):
                return
            await asyncio.sleep(_RESET_PAUSE)
        raise EngineError(f"{addr} refused to reset its prefix cache (requests still hold blocks)", 200, addr)


async def is_vllm(client: SGLangClient, addr: str) -> bool:
    """Whether the server at `addr` is vLLM: its `GET /v1/models` lists models owned by "vllm" (SGLang says
    "sglang"; the embedded server has no such route)."""
    status, body = await client.probe(addr, "/v1/models")
    if status != 200 or not isinstance(body, dict):
        return False
    return any(isinstance(m, dict) and m.get("owned_by") == "vllm" for m in body.get("data") or [])
