"""Speed on one device: quantization (13), the fast path (15) and the C++ int4/int8 CPU kernel (appendix A4)."""
