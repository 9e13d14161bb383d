"""Stand-ins for torch's block-scaled MX GEMMs (torch._scaled_mm, torch._scaled_grouped_mm) that
compute on CPU what torch's ops are documented to compute: the native GEMM backend's calls checked by
value without a Blackwell GPU."""

from __future__ import annotations

import torch

from mxmoe.quant import scale_layout as sl


class MXGemmSemantics:
    """Stand-ins for torch._scaled_mm / torch._scaled_grouped_mm that compute what torch's ops
    are documented to compute from what they are given (e4m3 operands times their e8m0 block
    scales read from the swizzled layout, fp32 GEMM, bf16 result; rows past the last group zero),
    so that the native path's orientation and scales are checked by value on CPU."""

    def __init__(self):
        self.calls = {"mm": 0, "grouped": 0}

    @staticmethod
    def _deq_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        """q (R, K) (any strides) times plain scales s (R, K / 32)."""
        return q.float() * s.float().repeat_interleave(32, dim=-1)

    def mm(self, a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
        self.calls["mm"] += 1
        M, K = a.shape
        N = b.shape[1]
        r128, c4 = sl.swizzled_shape(M, K // 32)
        s_a = sl.from_swizzled(scale_a.view(r128, c4), M, K // 32)
        r128, c4 = sl.swizzled_shape(N, K // 32)
        s_b = sl.from_swizzled(scale_b.view(r128, c4), N, K // 32)
        return (self._deq_rows(a, s_a) @ self._deq_rows(b.t(), s_b).t()).to(out_dtype)

    def grouped(self, a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                use_fast_accum=False):
        self.calls["grouped"] += 1
        ends = [0, *offs.tolist()]
        if b.ndim == 3:  # a (T, K), b (E, K, N)
            (T, K), (E, _, N) = a.shape, b.shape
            a_d = self._deq_rows(a, sl.from_swizzled_m_groups(scale_a, offs, T, K // 32))
            r128, c4 = sl.swizzled_shape(N, K // 32)
            s_b = sl.from_swizzled(scale_b.view(E, r128, c4), N, K // 32)
            out = torch.zeros(T, N)
            for e in range(E):
                out[ends[e] : ends[e + 1]] = a_d[ends[e] : ends[e + 1]] @ self._deq_rows(b[e].t(), s_b[e]).t()
            return out.to(out_dtype)
        # a (M, T) blocked along T, b (T, K) blocked along T, groups along T (multiples of 32)
        (M, T), K = a.shape, b.shape[1]
        k_offs = offs // 32
        a_d = self._deq_rows(a, sl.from_swizzled_k_groups(scale_a, k_offs, M, T // 32))
        b_d = self._deq_rows(b.t(), sl.from_swizzled_k_groups(scale_b, k_offs, K, T // 32)).t()
        out = torch.zeros(len(ends) - 1, M, K)
        for e in range(len(ends) - 1):
            out[e] = a_d[:, ends[e] : ends[e + 1]] @ b_d[ends[e] : ends[e + 1]]
        return out.to(out_dtype)
