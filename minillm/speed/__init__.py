"""Speed on one device: quantization (13), the C++ int4/int8 CPU kernel and the fast path (15)."""
