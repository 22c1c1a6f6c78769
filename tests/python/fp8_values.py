"""The value of every FP8 E4M3 code, for tests that dequantize what the FP8 patterns wrote."""
import numpy as np


def e4m3_values():
    """The value of every E4M3 code (OCP e4m3fn: bias 7, 0x7f / 0xff NaN)."""
    out = np.empty(256, dtype=np.float64)
    for c in range(256):
        e, m = (c >> 3) & 15, c & 7
        v = m * 2.0 ** -9 if e == 0 else (8 + m) * 2.0 ** (e - 10)
        out[c] = np.nan if (c & 0x7f) == 0x7f else (-v if c & 0x80 else v)
    return out
