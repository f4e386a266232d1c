"""Triton scatter of new K/V tokens into the paged caches (one program per token).

On CPU tensors it runs in Triton's interpreter; see pagedspec.kernels.triton_setup.
"""

import torch

from pagedspec.kernels.checks import check_write_kv_cache_args
from pagedspec.kernels.triton_setup import check_device, interpreted, tl, triton


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kc_n,
    stride_kc_b,
    stride_kc_h,
    stride_vc_n,
    stride_vc_b,
    stride_vc_h,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot >= 0:
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < num_kv_heads) & (d < head_dim)
        src = tok.to(tl.int64)
        k = tl.load(key_ptr + src * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + src * stride_vt + h * stride_vh + d, mask=mask)
        k_dst = block * stride_kc_n + offset * stride_kc_b + h * stride_kc_h + d
        v_dst = block * stride_vc_n + offset * stride_vc_b + h * stride_vc_h + d
        # a 16-bit cache under float32 keys: rounded to nearest
        tl.store(k_cache_ptr + k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write key/value [T, Hkv, D] into caches [N, B, Hkv, D] at slot = block * B + offset.

    In place; slot -1 skips the token. Slots are not range-checked (that would need a host
    sync): a slot >= N * B is out-of-bounds memory. Slots other than -1 must be distinct.
    """
    check_write_kv_cache_args(key, value, k_cache, v_cache, slot_mapping)
    check_device(_write_kv_kernel, key.device)
    if key.dtype != k_cache.dtype == torch.bfloat16 and interpreted(_write_kv_kernel):
        raise ValueError(
            "a bfloat16 cache under float32 keys is not supported by Triton's interpreter (it "
            "truncates instead of rounding to nearest); use float16 on the CPU, or CUDA tensors"
        )
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("key/value head_dim must be contiguous (stride 1)")
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
