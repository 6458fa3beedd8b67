"""The object-store encoding of a published version (rollout/ray_actor.py) keeps every tensor bit for bit."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from offpolicy_moe.rollout.ray_actor import decode_weights, encode_weights

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.bool]


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(0, 5), min_size=0, max_size=3), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_encode_then_decode_is_the_identity_bit_for_bit(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g, dtype=torch.float64) * 1e3).to(dtype)
    if dtype.is_floating_point and t.numel():
        t.view(-1)[0] = float("nan")
    back = decode_weights(encode_weights({"w": t, "strided": t.T if t.dim() == 2 else t}))
    for k, src in (("w", t), ("strided", t.T if t.dim() == 2 else t)):
        assert back[k].dtype == src.dtype and back[k].shape == src.shape
        assert torch.equal(back[k].reshape(-1).view(torch.uint8), src.contiguous().reshape(-1).view(torch.uint8))


def test_decoded_tensors_share_the_encoded_buffer():
    enc = encode_weights({"w": torch.arange(6, dtype=torch.float32)})
    dec = decode_weights(enc)
    assert dec["w"].data_ptr() == enc["w"][0].ctypes.data      # no copy on the actor's side
