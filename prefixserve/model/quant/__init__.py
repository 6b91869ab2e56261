"""Storage formats narrower than the model's dtype, dequantized where they are read:
`kv_cache.py` (the 8-bit KV cache: int8 or fp8 e4m3 rows, each with its own fp32 scale)."""
