"""Speed-ups in engine/model/causal_lm.py that must not change a single bit."""
import pytest
import torch
import torch.nn.functional as F

from engine.model.causal_lm import RMSNorm


@pytest.mark.parametrize("shape", [(1, 48), (16, 256), (64, 576), (513, 256), (3, 7, 64)])
def test_fused_rms_norm_is_bit_identical_to_the_hf_form(shape):
    """The float32 path (F.rms_norm with the weight, one op) equals the HF-style form (normalise, then scale)."""
    g = torch.Generator().manual_seed(sum(shape))
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
    x = torch.randn(shape, generator=g) * 3
    reference = norm.weight * F.rms_norm(x.float(), x.shape[-1:], eps=norm.eps).to(x.dtype)
    assert torch.equal(norm(x), reference)
    variance = x.pow(2).mean(-1, keepdim=True)  # transformers' LlamaRMSNorm, written out
    assert torch.equal(norm(x), norm.weight * (x * torch.rsqrt(variance + norm.eps)))


def test_half_precision_keeps_the_float32_normalisation():
    norm = RMSNorm(32, 1e-6).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    expected = norm.weight * F.rms_norm(x.float(), (32,), eps=1e-6).to(torch.bfloat16)
    assert torch.equal(norm(x), expected)
