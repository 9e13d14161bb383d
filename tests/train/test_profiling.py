"""Kernel categories of the profile breakdown (`mxmoe bench train --profile`)."""

import pytest

from mxmoe.train.profiling import KERNEL_CATEGORIES, kernel_category


@pytest.mark.parametrize(
    "name, want",
    [
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "gemm"),
        ("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT", "gemm"),
        ("_mx_gemm_kernel", "gemm"),  # an MX GEMM is a GEMM, not a cast
        ("qdq_rows_kernel", "mx cast / qdq"),
        ("void dim1_tile_kernel<__nv_bfloat16, 1, 2>(void const*, unsigned char*)", "mx cast / qdq"),
        ("void dequant_flat_kernel<256>(unsigned char const*)", "mx cast / qdq"),
        ("void qdq_dim0_kernel<0, 0, 0, 4>(uint4 const*, unsigned int*)", "mx cast / qdq"),
        ("void qdq_dim1_kernel<0, 0, 0, true, 4>(uint4 const*, unsigned int*)", "mx cast / qdq"),
        ("void swiglu_bwd_qdq_kernel<0, 0, 0, 8>(uint4 const*, uint4 const*)", "mx cast / qdq"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64", "attention"),
        ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
        ("void at::native::index_elementwise_kernel<128, 4>", "copy / index / pad"),
        ("Memset (Device)", "copy / index / pad"),
        ("triton_poi_fused_add_mul_silu_0", "inductor fused"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "other"),
    ],
)
def test_kernel_category(name, want):
    assert kernel_category(name) == want


def test_every_category_is_reachable_and_other_is_last():
    assert KERNEL_CATEGORIES[-1] == ("other", "")
    assert len({c for c, _ in KERNEL_CATEGORIES}) == len(KERNEL_CATEGORIES)
