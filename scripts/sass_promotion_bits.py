#!/usr/bin/env python3
"""Measurement tool (docs/PERF.md, fourteenth session): rewrites the scheduling bits of the block-scaled
GEMMs' promotion FFMAs in a copy of a linked binary, to time other instruction schedules without
changing what the kernels compute.

  python3 scripts/sass_promotion_bits.py VARIANT OUT BINARY CUBIN...

CUBIN: the sm_90a cubins of the objects linked into BINARY (`cuobjdump -xelf all x.cu.o`); each must
appear in BINARY byte for byte (nvcc's fatbins are uncompressed here). In every kernel of a cubin, a
promotion is the first 64 FFMAs `Rd = Ra * Rb + Rd` after a `WARPGROUP.DEPBAR` (acc += tmp * scale).
Their control bits (the 128-bit instruction's high word): bit 45 is the yield hint (ptxas sets it on
an instruction whose operand it keeps in the reuse cache, clears it on the others), bits 58-61 the
operand reuse flags. Variants:
  Y  every promotion FFMA yields: reuse flags and bit 45 cleared
  H  the same on the first half of each promotion only
  N  bit 45 set on every promotion FFMA, reuse kept
Only hints change: the results are bit-identical (test_batched_experts passes on a Y binary).
"""
import struct
import sys

REUSE = 0xF << 58
YIELD_BIT = 1 << 45
FFMA, WARPGROUP, EXIT = 0x223, 0x9C5, 0x94D  # the low 12 bits of the instruction's low word


def kernels(cubin):
    """(name, offset, size) of each .text section of an ELF64 cubin."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    strtab = sections[shstrndx][4]
    for s in sections:
        end = cubin.index(b"\0", strtab + s[0])
        name = cubin[strtab + s[0] : end].decode()
        if name.startswith(".text."):
            yield name[6:], s[4], s[5]


def promotions(words):
    """Instruction indices of each promotion: 64 FFMAs Rd = Ra * Rb + Rd after a WARPGROUP.DEPBAR."""
    found, cur = [], None
    for i, (lo, hi) in enumerate(words):
        op = lo & 0xFFF
        if op == WARPGROUP:  # DEPBAR (bit 47 of the low word) starts one, ARRIVE ends one
            cur = [] if (lo >> 47) & 1 else None
        elif op == EXIT:
            cur = None
        elif op == FFMA and cur is not None and ((lo >> 16) & 0xFF) == (hi & 0xFF):
            cur.append(i)
            if len(cur) == 64:
                found.append(cur)
                cur = None
    return found


def main():
    if len(sys.argv) < 5 or sys.argv[1] not in ("Y", "H", "N"):
        sys.exit(__doc__)
    variant, out, binary, cubins = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
    data = bytearray(open(binary, "rb").read())
    total = 0
    for path in cubins:
        cubin = open(path, "rb").read()
        base = data.find(cubin)
        if base < 0 or data.find(cubin, base + 1) >= 0:
            sys.exit(f"{path}: not found exactly once in {binary} (built from other objects, or compressed)")
        for name, off, size in kernels(cubin):
            words = [struct.unpack_from("<QQ", cubin, off + 16 * i) for i in range(size // 16)]
            changed = 0
            for p in promotions(words):
                for i in p if variant != "H" else p[: len(p) // 2]:
                    hi = words[i][1]
                    new = hi | YIELD_BIT if variant == "N" else hi & ~REUSE & ~YIELD_BIT
                    if new != hi:
                        struct.pack_into("<Q", data, base + off + 16 * i + 8, new)
                        changed += 1
            if changed:
                print(f"{name[:100]}: {changed} FFMAs")
                total += changed
    open(out, "wb").write(data)
    print(f"{out}: {total} FFMAs changed")


if __name__ == "__main__":
    main()
