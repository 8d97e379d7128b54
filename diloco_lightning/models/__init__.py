"""Model definitions (plain ``torch.nn``; no Lightning import)."""

from diloco_lightning.models.llama import MODEL_PRESETS, Llama, LlamaConfig, count_parameters, llama_config

__all__ = ["MODEL_PRESETS", "Llama", "LlamaConfig", "count_parameters", "llama_config"]
