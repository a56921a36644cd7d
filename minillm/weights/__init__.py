"""Getting weights in: safetensors and GGUF files (06), the hub, the embedded SmolLM2, LoRA adapters (19)."""
