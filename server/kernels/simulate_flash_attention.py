#!/usr/bin/env python3
"""Lane-level NumPy model of `flash_attention` in attention.cu, for checking its index arithmetic
without a GPU. Every register is modelled per lane, `mma.sync.m16n8k16` and `ldmatrix.x4.trans`
follow the fragment layouts of the PTX ISA, and the kernel body below mirrors the CUDA line by
line (same names). It checks the kernel's *indexing*, not the hardware: a wrong belief about a
PTX layout would be wrong here too; `exactscore-bench check` on a device is the real test.

    python3 server/kernels/simulate_flash_attention.py    # exits 1 on a mismatch
"""
import sys

import numpy as np

ROWS, KEYS, THREADS = 64, 64, 128


def bf16(x):
    """Round float32 to bfloat16 (nearest even), returned as float32."""
    b = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
    return b.astype(np.uint32).view(np.float32)


def lanes():
    return [(lane, lane // 4, lane % 4) for lane in range(32)]


def mma(c, a, b):
    """c[lane][4] += A·B for one warp; a[lane] = 4 pairs, b[lane] = 2 pairs (PTX m16n8k16 layouts)."""
    A, B, C = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32)
    for lane, g, t in lanes():
        for half, (r, k) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[r, k], A[r, k + 1] = a[lane][half]
        for half, k in enumerate([2 * t, 2 * t + 8]):
            B[k, g], B[k + 1, g] = b[lane][half]
        C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1] = c[lane]
    D = A.astype(np.float64) @ B + C
    for lane, g, t in lanes():
        c[lane] = [D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]]


def ldmatrix_x4_trans(smem, addr):
    """addr[lane] = flat smem index of the row lane supplies (lanes 8i..8i+7: rows of matrix i)."""
    mats = [np.array([smem[addr[8 * i + r]: addr[8 * i + r] + 8] for r in range(8)]) for i in range(4)]
    return [[(m[2 * t, g], m[2 * t + 1, g]) for m in mats] for lane, g, t in lanes()]


def flash_attention_block(q, k, v, out, starts, hq, hkv, scale_log2, window, D, seq, head, qblock):
    LD = D + 8
    ks, vs = np.zeros(KEYS * LD, np.float32), np.zeros(KEYS * LD, np.float32)
    start, length = starts[seq], starts[seq + 1] - starts[seq]
    q0 = qblock * ROWS
    if q0 >= length:
        return
    kv_head = head // (hq // hkv)
    q_stride, kv_stride = hq * D, hkv * D

    def load_tile(dst, src, col0, stride, row0):  # src: flat array
        for i in range(KEYS * (D // 8)):
            r, c = i // (D // 8), (i % (D // 8)) * 8
            val = src[(start + row0 + r) * stride + col0 + c:][:8] if row0 + r < length else np.zeros(8)
            dst[r * LD + c: r * LD + c + 8] = val

    load_tile(ks, q, head * D, q_stride, q0)
    qf, acc, m, l, row = {}, {}, {}, {}, {}
    for warp in range(4):
        for lane, g, t in lanes():
            wr = warp * 16 + g
            r0, r1 = wr * LD, (wr + 8) * LD
            qf[warp, lane] = [[(ks[r0 + kk * 16 + 2 * t], ks[r0 + kk * 16 + 2 * t + 1]),
                               (ks[r1 + kk * 16 + 2 * t], ks[r1 + kk * 16 + 2 * t + 1]),
                               (ks[r0 + kk * 16 + 8 + 2 * t], ks[r0 + kk * 16 + 9 + 2 * t]),
                               (ks[r1 + kk * 16 + 8 + 2 * t], ks[r1 + kk * 16 + 9 + 2 * t])]
                              for kk in range(D // 16)]
            acc[warp, lane] = [[0.0] * 4 for _ in range(D // 8)]
            m[warp, lane], l[warp, lane] = [-np.inf, -np.inf], [0.0, 0.0]
            row[warp, lane] = [q0 + wr, q0 + wr + 8]

    last_key = min(q0 + ROWS, length) - 1
    first_tile = max(0, q0 - window + 1) // KEYS if window > 0 else 0
    for tile in range(first_tile, last_key // KEYS + 1):
        k0 = tile * KEYS
        load_tile(ks, k, kv_head * D, kv_stride, k0)
        load_tile(vs, v, kv_head * D, kv_stride, k0)
        for warp in range(4):
            s = {lane: [[0.0] * 4 for _ in range(KEYS // 8)] for lane in range(32)}
            for kk in range(D // 16):
                for n in range(KEYS // 8):
                    c = [s[lane][n] for lane in range(32)]
                    b = []
                    for lane, g, t in lanes():
                        kr = (n * 8 + g) * LD + kk * 16 + 2 * t
                        b.append([(ks[kr], ks[kr + 1]), (ks[kr + 8], ks[kr + 9])])
                    mma(c, [qf[warp, lane][kk] for lane in range(32)], b)
                    for lane in range(32):
                        s[lane][n] = c[lane]
            edge = k0 + KEYS - 1 > q0 or window > 0
            tile_max = {lane: [-np.inf, -np.inf] for lane in range(32)}
            for lane, g, t in lanes():
                for n in range(KEYS // 8):
                    for e in range(4):
                        r, key = e // 2, k0 + n * 8 + 2 * t + (e & 1)
                        x = np.float32(s[lane][n][e]) * np.float32(scale_log2)
                        rw = row[warp, lane][r]
                        if edge and (key > rw or (window > 0 and rw - key >= window)):
                            x = -np.inf
                        s[lane][n][e] = x
                        tile_max[lane][r] = max(tile_max[lane][r], x)
            for lane, g, t in lanes():  # __shfl_xor 1 and 2: the quad of lanes sharing g
                quad = [4 * g + i for i in range(4)]
                for r in range(2):
                    tm = max(tile_max[o][r] for o in quad)
                    m_new = max(m[warp, lane][r], tm)
                    base = 0.0 if m_new == -np.inf else m_new
                    alpha = np.exp2(m[warp, lane][r] - base)
                    m[warp, lane][r] = m_new
                    l[warp, lane][r] *= alpha
                    for d in range(D // 8):
                        acc[warp, lane][d][2 * r] *= alpha
                        acc[warp, lane][d][2 * r + 1] *= alpha
                    for n in range(KEYS // 8):
                        for e in (2 * r, 2 * r + 1):
                            p = np.exp2(s[lane][n][e] - base)
                            s[lane][n][e] = p
                            l[warp, lane][r] += p
            for j in range(KEYS // 16):
                a = [[(bf16(s[lane][2 * j][0]), bf16(s[lane][2 * j][1])),
                      (bf16(s[lane][2 * j][2]), bf16(s[lane][2 * j][3])),
                      (bf16(s[lane][2 * j + 1][0]), bf16(s[lane][2 * j + 1][1])),
                      (bf16(s[lane][2 * j + 1][2]), bf16(s[lane][2 * j + 1][3]))] for lane in range(32)]
                for dp in range(D // 16):
                    addr = [(j * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * LD + dp * 16 + (lane >> 4) * 8
                            for lane in range(32)]
                    b = ldmatrix_x4_trans(vs, addr)
                    for tile_d, regs in ((2 * dp, (0, 1)), (2 * dp + 1, (2, 3))):
                        c = [acc[warp, lane][tile_d] for lane in range(32)]
                        mma(c, a, [[b[lane][regs[0]], b[lane][regs[1]]] for lane in range(32)])
                        for lane in range(32):
                            acc[warp, lane][tile_d] = c[lane]
    for warp in range(4):
        for lane, g, t in lanes():
            quad = [4 * g + i for i in range(4)]
            for r in range(2):
                total = sum(l[warp, o][r] for o in quad)
                if row[warp, lane][r] >= length:
                    continue
                dst = (start + row[warp, lane][r]) * q_stride + head * D + 2 * t
                for d in range(D // 8):
                    out[dst + d * 8] = bf16(acc[warp, lane][d][2 * r] / total)
                    out[dst + d * 8 + 1] = bf16(acc[warp, lane][d][2 * r + 1] / total)


def reference(q, k, v, lens, hq, hkv, D, window):
    out, start = [], 0
    for n in lens:
        qs = q[start:start + n].astype(np.float64)
        ks = np.repeat(k[start:start + n], hq // hkv, axis=1).astype(np.float64)
        vs = np.repeat(v[start:start + n], hq // hkv, axis=1).astype(np.float64)
        s = np.einsum("ihd,jhd->hij", qs, ks) / np.sqrt(D)
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        visible = (j <= i) & ((i - j < window) if window > 0 else True)
        s = np.where(visible, s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out.append(np.einsum("hij,jhd->ihd", p, vs).reshape(n, hq * D))
        start += n
    return np.concatenate(out)


def main():
    rng = np.random.default_rng(0)
    ok = True
    for D, lens, window in [(64, [130, 1, 70], 0), (128, [100], 0), (64, [150], 40)]:
        hq, hkv = 4, 2
        tokens = sum(lens)
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(int)
        q = bf16(rng.standard_normal((tokens, hq, D)) * 2)
        k = bf16(rng.standard_normal((tokens, hkv, D)))
        v = bf16(rng.standard_normal((tokens, hkv, D)))
        out = np.full(tokens * hq * D, np.nan, np.float32)
        blocks = -(-max(lens) // ROWS)
        for seq in range(len(lens)):
            for head in range(hq):
                for qblock in range(blocks):
                    flash_attention_block(q.ravel(), k.ravel(), v.ravel(), out, starts, hq, hkv,
                                          np.float32(1 / np.sqrt(D) * np.log2(np.e)), window, D,
                                          seq, head, qblock)
        out = out.reshape(tokens, hq * D)
        want = reference(q, k, v, lens, hq, hkv, D, window)
        err = np.abs(out - want).max() / np.abs(want).max()
        good = not np.isnan(out).any() and err < 0.02
        ok &= good
        print(f"D={D} lens={lens} window={window}: max |Δ|/max|ref| = {err:.2e} {'ok' if good else 'FAIL'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
