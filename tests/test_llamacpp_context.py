"""`models/llamacpp_context.SeqContext`: the one llama.cpp context of several sequences (stop 51), on
tiny-llama's f16 GGUF (the node cache's export, shared with the teacher's tests).

- sequences in one unified KV stream share all `n_seq * n_ctx_seq` cells: one sequence may reach all of
  them, and a decode past them is one SmolforgeError that carries the caller's fix (not a return code);
- rows come back in entry order as a view of llama.cpp's buffer, the same array object step after step.
The teacher's and the engine's uses are tested in test_teacher_llamacpp.py and serve/test_llamacpp_engine.py.
"""

from __future__ import annotations

import pytest

from helpers import require_module
from smolforge.errors import SmolforgeError

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model():
    require_module("llama_cpp", "llama-cpp-python (smolforge[export])", "make install")
    import llama_cpp

    from smolforge.models.export.cache import cached_gguf

    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    handle = llama_cpp.llama_model_load_from_file(str(cached_gguf("tiny-llama", "f16")).encode(), params)
    yield llama_cpp, handle
    llama_cpp.llama_model_free(handle)


def test_one_sequence_may_fill_the_shared_cells_and_a_full_cache_is_one_message_with_the_fix(model):
    from smolforge.models.llamacpp_context import SeqContext

    lc, handle = model
    ctx = SeqContext(lc, handle, n_seq=2, n_ctx_seq=128, n_batch=256, threads=1, fix="lower --the-batch")
    try:
        assert ctx.n_ctx_seq == 256  # unified: one sequence may reach every cell of the two
        n = ctx.decode((1, pos, 1 + pos % 50, pos == 255) for pos in range(256))  # sequence 1 alone fills them
        assert (n, ctx.rows(n).shape) == (1, (1, ctx.n_vocab))
        with pytest.raises(SmolforgeError) as err:
            ctx.decode([(0, 0, 1, True)])  # no cell left for sequence 0
        assert err.value.fix == "lower --the-batch" and "decode failed" in err.value.what
        ctx.drop(1, 128)  # half of sequence 1's cells freed: sequence 0 fits again
        n = ctx.decode([(0, 0, 1, True), (1, 128, 7, True)])
        view = ctx.view()
        assert n == 2 and ctx.view() is view and ctx.rows(2).shape == (2, ctx.n_vocab)  # the same array: no new view
    finally:
        ctx.close()
