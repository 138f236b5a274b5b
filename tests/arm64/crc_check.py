#!/usr/bin/env python3
"""Run under emulated aarch64 python: int4pack's C++ CRC-32 (zlib's) and CRC-32C, the Arm CRC32
instruction path and the table path, against zlib.crc32 and a bitwise CRC-32C written here.
Prints one JSON line; exit status 0 only if every checksum agrees.

Usage:  /tmp/arm64emu/bin/python3-arm64 tests/arm64/crc_check.py   (int4pack/_kernels-aarch64.so built)
"""

import json
import random
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from int4pack._native import ConvertKernels, open_library  # noqa: E402


def crc32c_bitwise(data: bytes) -> int:
    c = 0xFFFFFFFF
    for x in data:
        c ^= x
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
    return c ^ 0xFFFFFFFF


def main() -> int:
    lib = ConvertKernels(open_library())
    rng = random.Random(7)
    bad, checked = [], 0
    # around 8-byte steps and the 3 x 8 KB blocks of CRC-32C's three chains
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 1000, 8191, 3 * 8192 - 1, 3 * 8192, 3 * 8192 + 13, 6 * 8192 + 5):
        data = bytes(rng.getrandbits(8) for _ in range(n))
        for hw in (True, False):
            lib.use_crc32_clmul(hw)
            whole, parts = lib.crc32(data), lib.crc32(data[n // 3:], lib.crc32(data[:n // 3]))
            checked += 2
            if whole != zlib.crc32(data) or parts != zlib.crc32(data):
                bad.append(f"crc32 n={n} hardware={hw}: {whole:08x} / {parts:08x}, zlib {zlib.crc32(data):08x}")
        want = crc32c_bitwise(data)
        got, parts = lib.crc32c(data), lib.crc32c(data[n // 3:], lib.crc32c(data[:n // 3]))
        checked += 2
        if got != want or parts != want:
            bad.append(f"crc32c n={n}: {got:08x} / {parts:08x}, bitwise {want:08x}")
    lib.use_crc32_clmul(True)
    print(json.dumps({"checked": checked, "bad": bad}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
