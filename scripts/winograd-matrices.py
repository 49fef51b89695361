#!/usr/bin/env python3
"""The matrices of kernels/cpu/winograd.cpp: Winograd F(m, r) by Toom-Cook interpolation.

For the points p_0..p_{a-2} and infinity (a = m + r - 1):
  A^T[i][j] = p_j^i, G[j][k] = p_j^k / prod_{l != j} (p_j - p_l), the last column of A^T and
  row of G for the point at infinity; B^T is then the solution (exact rationals) of
      sum_j A^T[i][j] G[j][k] B^T[j][l] = [l == i + k]   for every i < m, k < r, l < a,
  which makes y = A^T [(G g) (.) (B^T d)] the correlation y_i = sum_k g_k d_{i+k}.
It prints each form's matrices and the float32 error of the 2-D algorithm on random 64-channel
tiles for several point sets (the kernels use the most accurate one found here).
  /usr/bin/python3 scripts/winograd-matrices.py     (needs sympy and numpy)
"""
import numpy as np
import sympy as sp

R = sp.Rational


def derive(m, r, points):
    a = m + r - 1
    P = [R(p) for p in points]
    assert len(P) == a - 1
    AT, G = sp.zeros(m, a), sp.zeros(a, r)
    for j, p in enumerate(P):
        f = sp.prod([p - q for q in P if q != p])
        for i in range(m):
            AT[i, j] = p**i
        for k in range(r):
            G[j, k] = p**k / f
    AT[m - 1, a - 1] = 1
    G[a - 1, r - 1] = 1
    b = sp.symbols(f"b0:{a * a}")
    BT = sp.Matrix(a, a, b)
    eqs = [sum(AT[i, j] * G[j, k] * BT[j, l] for j in range(a)) - (1 if l == i + k else 0)
           for i in range(m) for k in range(r) for l in range(a)]
    sol = sp.solve(eqs, b, dict=True)
    assert len(sol) == 1, "no unique B^T for these points"
    return AT, G, BT.subs(sol[0])


def error(m, r, AT, G, BT, channels=64, trials=200, seed=0):
    """Median and largest |error| of a 2-D tile over 64 channels, / sqrt(channels * r^2)."""
    a = m + r - 1
    f = lambda M: np.array(M.tolist(), dtype=np.float64).astype(np.float32)
    AT, G, BT = f(AT), f(G), f(BT)
    rng = np.random.default_rng(seed)
    errs = []
    for _ in range(trials):
        d = rng.standard_normal((channels, a, a)).astype(np.float32)
        g = rng.standard_normal((channels, r, r)).astype(np.float32)
        ref = np.zeros((m, m))
        for y in range(m):
            for x in range(m):
                ref[y, x] = (d[:, y:y + r, x:x + r].astype(np.float64) * g).sum()
        U = np.einsum("ij,cjk,lk->cil", G, g, G).astype(np.float32)
        V = np.einsum("ij,cjk,lk->cil", BT, d, BT).astype(np.float32)
        Y = AT @ (U * V).sum(0, dtype=np.float32) @ AT.T
        errs.append(np.abs(Y - ref).max() / np.sqrt(channels * r * r))
    return np.median(errs), np.max(errs)


for m, r, sets in ((2, 5, [(0, 1, -1, 2, -2), (0, 1, -1, R(1, 2), -2), (0, 1, -1, 2, R(-1, 2))]),
                   (4, 3, [(0, 1, -1, 2, -2), (0, 1, -1, R(1, 2), -2), (0, 1, -1, R(1, 2), R(-1, 2))])):
    for pts in sets:
        AT, G, BT = derive(m, r, pts)
        med, worst = error(m, r, AT, G, BT)
        print(f"F({m}x{m}, {r}x{r}) points {[str(p) for p in pts]} + inf: "
              f"error median {med:.2e}, largest {worst:.2e}")
        print("  AT =", AT.tolist())
        print("  G  =", G.tolist())
        print("  BT =", BT.tolist())
