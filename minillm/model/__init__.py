"""The model: strided tensors (01), attention (02), RoPE (03), RMSNorm and SwiGLU (04), the decoder (05)."""
