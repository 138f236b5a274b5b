"""formats/_common.py: the g_idx read that skips the trivial index, and the checkpoint's reads under it."""

from __future__ import annotations

import os

import numpy as np
import pytest

from int4pack.checkpoint import Checkpoint
from int4pack.errors import InputError
from int4pack.formats._common import g_idx_unless_trivial

K, GROUP = 64, 16


def _ckpt(make_ckpt, g_idx: np.ndarray) -> Checkpoint:
    return Checkpoint(make_ckpt({"m.g_idx": g_idx, "m.other": np.arange(6, dtype=np.int32)}, {"quant_method": "gptq"}))


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.int16])
def test_trivial_g_idx_is_none_in_every_stored_dtype(make_ckpt, dtype):
    ck = _ckpt(make_ckpt, (np.arange(K) // GROUP).astype(dtype))
    assert g_idx_unless_trivial(ck, "m.g_idx", K, K // GROUP, GROUP) is None


def test_permuted_g_idx_is_returned(make_ckpt):
    g = (np.arange(K) // GROUP).astype(np.int32)
    g[[3, 40]] = g[[40, 3]]
    got = g_idx_unless_trivial(_ckpt(make_ckpt, g), "m.g_idx", K, K // GROUP, GROUP)
    assert got is not None and got.tolist() == g.tolist()


def test_trivial_index_past_the_scales_is_refused(make_ckpt):
    """arange(K) // group names group 3, but the scales hold 3 groups: the range check still runs."""
    ck = _ckpt(make_ckpt, (np.arange(K) // GROUP).astype(np.int32))
    with pytest.raises(InputError, match="out of range"):
        g_idx_unless_trivial(ck, "m.g_idx", K, 3, GROUP)


def test_reads_share_one_descriptor_per_shard_and_close_it(make_ckpt):
    ck = _ckpt(make_ckpt, (np.arange(K) // GROUP).astype(np.int32))
    a = ck.get("m.g_idx")
    fds = dict(ck._fds)
    assert len(fds) == 1
    b = ck.get("m.other")
    assert ck._fds == fds  # the second tensor of the shard: no new descriptor
    a[0] = 99  # private memory: a later read is unaffected
    assert int(ck.get("m.g_idx")[0]) == 0 and b.tolist() == list(range(6))
    ck.close()
    with pytest.raises(OSError):
        os.fstat(next(iter(fds.values())))  # closed
    assert ck.get("m.other").tolist() == list(range(6))  # and reopened on demand
    ck.close()
