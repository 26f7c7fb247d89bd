"""A vLLM worker extension (`--worker-extension-cls areal_lite_vllm_worker.WeightReloadExtension`): reload the
weights from a folder, right for models whose output layer shares the input embedding (tied embeddings).

Runs inside vLLM's worker process and imports only torch (vLLM calls it with its own objects); see
`kit/server/vllm_ext/__init__.py` for how it gets there. The client calls it through vLLM's development endpoint
`POST /collective_rpc {"method": "areal_lite_reload_weights", "args": [folder]}` and then resets the prefix cache.

Design decisions
- vLLM's own `reload_weights` (the worker's, used through `/collective_rpc`) is silently wrong for a tied model
  such as SmolLM2: every layer is reloaded except the output layer (`lm_head`), which the checkpoint does not hold
  (it *is* the embedding) and which keeps the old weights -- vLLM only logs "Failed to load weights". So after the
  reload the output layer is tied to the new embedding again, and its quantization method re-runs
  `process_weights_after_loading`: on CPU that is where the output layer's matrix-multiply kernel takes its own
  (packed) copy of the weights, which would otherwise still be the old one. On a GPU that step changes nothing.
- AReaL 1.0.4's extension loads in place with the model loader instead; on CPU that fails, because the CPU kernels
  repack each linear layer's weights and free the original parameter. vLLM's layer-wise reload rebuilds them.
- It answers a short string (JSON-safe) and raises on failure, so `/collective_rpc` answers HTTP 500 with the
  error instead of a success nobody checks.
"""

from __future__ import annotations

__all__ = ["WeightReloadExtension"]


class WeightReloadExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self` is the worker."""

    def areal_lite_reload_weights(self, model_path: str) -> str:
        self.reload_weights(weights_path=model_path)  # vLLM's layer-wise reload, under the worker's config
        model = self.model_runner.get_model()
        hf_config = getattr(self.model_config, "hf_text_config", None) or getattr(model, "config", None)
        tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        lm_head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if tied and lm_head is not None and embed is not None and hasattr(lm_head, "quant_method"):
            lm_head.weight = embed.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)
        return f"reloaded {model_path} (tied output layer re-tied: {tied})"
