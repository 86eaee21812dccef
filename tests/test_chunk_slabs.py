"""chunk_slabs: the pieces compare reads a tensor in cover it in C order, each within the
chunk, also when one row of the first dim is larger than the chunk ((1, 2^26) was read
whole: 1.1 GB resident)."""

from __future__ import annotations

import numpy as np
import pytest

from dumpfile.read.reader import chunk_slabs


@pytest.mark.parametrize("shape,chunk", [((1, 1000), 64), ((3, 5, 7), 4), ((3, 5, 7), 35), ((3, 5, 7), 36),
                                         ((10, 10), 25), ((7,), 3), ((2, 1, 9), 1), ((4, 0, 3), 5)])
def test_slabs_cover_the_tensor_in_c_order_within_the_chunk(shape, chunk):
    x = np.arange(int(np.prod(shape))).reshape(shape)
    pieces = []
    for start, count in chunk_slabs(shape, chunk):
        assert int(np.prod(count)) <= chunk
        pieces.append(x[tuple(slice(a, a + c) for a, c in zip(start, count))].reshape(-1))
    got = np.concatenate(pieces) if pieces else np.empty(0, x.dtype)
    np.testing.assert_array_equal(got, x.reshape(-1))


def test_rows_that_fit_keep_the_first_dim_split():
    """The pieces the metrics' summation order was fixed on: whole rows of dim 0."""
    assert list(chunk_slabs((10, 4), 8)) == [((i, 0), (2, 4)) for i in range(0, 10, 2)]
