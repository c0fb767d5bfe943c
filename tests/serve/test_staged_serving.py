"""Staged serving in one process: a model cut into 2 or 3 `StageServer`s behind a `StagedModel`
generates exactly the tokens of the single-process `ServedModel` (and of HF `generate`), batched
prompts of different lengths, with and without a LoRA adapter, rows leaving at different steps; over
HTTP (the app and engine `serve --stages` runs), `n`, the penalties and `logit_bias` give the
single-process server's answers; a shared prefix is computed once on every stage, never restored
across a changed stage (issue 44)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from smolforge.errors import SmolforgeError
from smolforge.serve.batch import DoneEvent, ErrorEvent, Request
from smolforge.serve.engine import Engine
from smolforge.serve.model import ServedModel
from smolforge.serve.sampling import SamplingParams
from smolforge.serve.stages import StageError, StageServer, local_stages, staged_model, to_wire

from test_serve_engine import GREEDY, hf_greedy, prompts, run_together

BOUNDS = {2: [0, 2, 4], 3: [0, 1, 3, 4]}
# The placement plan may leave an end stage without layers (tiny models: a cut's latency outweighs a layer)
EDGE_BOUNDS = {"embeddings-alone": [0, 0, 4], "head-alone": [0, 4, 4], "3-empty-ends": [0, 0, 4, 4]}


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    return ServedModel.load(str(tiny_llama_dir), name="tiny", device="cpu")


def run_with_limits(model, ps: list[list[int]], limits: list[int]) -> list[DoneEvent]:
    done: dict[int, DoneEvent] = {}
    reqs = [Request(p, SamplingParams(max_tokens=n, temperature=0),
                    (lambda i: lambda e: done.__setitem__(i, e) if isinstance(e, (DoneEvent, ErrorEvent)) else None)(i))
            for i, (p, n) in enumerate(zip(ps, limits))]
    Engine(model).run_batch(reqs)
    return [done[i] for i in range(len(ps))]


@pytest.mark.parametrize("n", [2, 3, *EDGE_BOUNDS])
def test_stages_generate_the_single_process_tokens(tiny_llama_dir, served, n):
    stages = local_stages(str(tiny_llama_dir), {**BOUNDS, **EDGE_BOUNDS}[n])
    model = staged_model(str(tiny_llama_dir), stages, name="tiny")
    assert model.eos_ids == served.eos_ids and model.max_positions == served.max_positions
    ps = prompts(served.tokenizer)
    assert len({len(p) for p in ps}) == len(ps)
    expected = [hf_greedy(served.model, p, GREEDY.max_tokens, served.pad_id) for p in ps]
    assert [d.token_ids for d in run_together(served, ps, GREEDY)] == expected
    got = run_together(model, ps, GREEDY)
    assert [d.token_ids for d in got] == expected
    assert [d.text for d in got] == [d.text for d in run_together(served, ps, GREEDY)]
    assert all(not s.caches for s in stages)  # every batch's cache was freed
    # each stage holds only its layers: less than the model unless it holds every layer (then with a head
    # copy of its own when the embeddings are elsewhere)
    full = sum(p.numel() for p in served.model.parameters())
    assert all(s.info()["params"] < full for s in stages if s.info()["layers"][1] - s.info()["layers"][0] < 4)


def test_rows_leaving_at_different_steps_cut_every_stages_cache(tiny_llama_dir, served):
    """The longest prompts leave first, so each stage also drops left padding (the select path)."""
    stages = local_stages(str(tiny_llama_dir), BOUNDS[3])
    model = staged_model(str(tiny_llama_dir), stages)
    ps = sorted(prompts(served.tokenizer), key=len, reverse=True)
    limits = [3 + 5 * i for i in range(len(ps))]
    trims: list[tuple[int, bool]] = []
    for s in stages:
        def spy(batch_id, rows, trim, _select=s.select):
            out = _select(batch_id, rows, trim)
            trims.append((trim, out))
            return out
        s.select = spy
    got = run_with_limits(model, ps, limits)
    assert any(trim and done for trim, done in trims)  # left padding was dropped on the stages
    local = run_with_limits(served, ps, limits)
    for i, p in enumerate(ps):
        assert got[i].token_ids == local[i].token_ids == hf_greedy(served.model, p, limits[i], served.pad_id), i
        assert got[i].finish_reason == local[i].finish_reason
    assert all(not s.caches for s in stages)


def test_a_lora_adapter_is_merged_on_every_stage(tiny_llama_dir, served, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    from smolforge.models.loading import load_model

    torch.manual_seed(0)
    peft_model = get_peft_model(load_model(str(tiny_llama_dir)),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                           init_lora_weights=False))  # random B: the adapter changes the output
    adapter = tmp_path / "lora_adapter"
    peft_model.save_pretrained(adapter)
    reference = PeftModel.from_pretrained(load_model(str(tiny_llama_dir)), str(adapter)).eval()
    ps = prompts(served.tokenizer)
    expected = [hf_greedy(reference, p, GREEDY.max_tokens, served.pad_id) for p in ps]
    assert expected != [hf_greedy(served.model, p, GREEDY.max_tokens, served.pad_id) for p in ps]  # it matters
    single = ServedModel.load(str(tiny_llama_dir), str(adapter), device="cpu")
    assert [d.token_ids for d in run_together(single, ps, GREEDY)] == expected
    for n in (2, 3):
        model = staged_model(str(tiny_llama_dir), local_stages(str(tiny_llama_dir), BOUNDS[n], adapter=str(adapter)))
        assert [d.token_ids for d in run_together(model, ps, GREEDY)] == expected, n


def test_a_stage_without_the_batchs_cache_fails_that_batch_only(tiny_llama_dir, served):
    """A stage that lost its caches (restarted) is an error for the running batch; the next batch works."""
    stages = local_stages(str(tiny_llama_dir), BOUNDS[2])
    model = staged_model(str(tiny_llama_dir), stages)
    ps = prompts(served.tokenizer)[:2]

    class Forgetful:
        def __init__(self, inner):
            self.inner, self.calls = inner, 0

        def forward(self, batch_id, x, mask, positions, start=False):
            self.calls += 1
            if self.calls == 3:
                self.inner.caches.clear()
            return self.inner.forward(batch_id, x, mask, positions, start)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    model.stages[1] = Forgetful(stages[1])
    got = run_with_limits(model, ps, [10, 10])
    assert all(isinstance(e, ErrorEvent) and "holds no cache" in e.message for e in got)
    assert not stages[0].caches  # the other stage's cache was released
    again = run_with_limits(model, ps, [10, 10])
    assert [e.token_ids for e in again] == [d.token_ids for d in run_with_limits(served, ps, [10, 10])]
    with pytest.raises(StageError):
        stages[0].forward("nope", to_wire(torch.tensor([[1, 2]])), np.ones((1, 2), np.int64),
                          np.arange(2)[None])


def test_bad_stage_index_is_refused(tiny_llama_dir):
    with pytest.raises(SmolforgeError, match="stage 2 does not exist"):
        StageServer.load(str(tiny_llama_dir), [0, 2, 4], 2)


def test_a_short_request_sent_during_a_long_one_ends_first_on_2_stages(tiny_llama_dir, served):
    """Per-step scheduling through stages: the short request's rows join the long one's cache on every
    stage (`StageServer.join`) at the next step; both get the tokens they get alone."""
    from test_serve_engine import short_during_long

    stages = local_stages(str(tiny_llama_dir), BOUNDS[2])
    model = staged_model(str(tiny_llama_dir), stages, name="tiny")
    ps = prompts(served.tokenizer)
    engine = Engine(model, max_batch=4).start()
    try:
        order, long_done, short_done = short_during_long(engine, ps[2], ps[1])
    finally:
        engine.stop()
    assert engine.joins and long_done.finish_reason == "length" and long_done.completion_tokens == 40
    assert order == ["short", "long"]
    assert (engine.batches, engine.largest_batch) == (1, 2)
    assert long_done.token_ids == hf_greedy(served.model, ps[2], 40, served.pad_id)
    assert short_done.token_ids == hf_greedy(served.model, ps[1], 6, served.pad_id)
    assert all(not s.caches for s in stages)  # the joined batch's cache and the long one's are both gone
    # a prompt over the step's budget is read in chunks through the stages' open caches: the same tokens
    events: list = []
    chunked = Engine(model, step_tokens=6)
    chunked.run_batch([Request(ps[2], SamplingParams(max_tokens=8, temperature=0), events.append)])
    assert len(ps[2]) > 2 * 6 and chunked.prefill_tokens == len(ps[2])
    assert events[-1].token_ids == hf_greedy(served.model, ps[2], 8, served.pad_id)


def test_n_and_penalties_through_stages_give_the_single_process_answers(tiny_llama_dir, served):
    """`serve --stages` runs the same app and engine over a `StagedModel` (cluster/workloads/serve/runner.py),
    so its sampling is the one process's: `n` choices with a seed, frequency/presence penalties and
    `logit_bias`, streamed and not, through the official client, equal the single-process server's."""
    from test_llamacpp_engine import Live

    staged = Live(staged_model(str(tiny_llama_dir), local_stages(str(tiny_llama_dir), BOUNDS[2]), name="tiny"))
    single = Live(served)
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "the the the the the the"}], "max_tokens": 8,
           "temperature": 1.0, "seed": 5, "n": 3, "frequency_penalty": 1.5, "presence_penalty": 0.5}
    greedy = {"model": "tiny", "prompt": "the the the the the the", "max_tokens": 10, "temperature": 0,
              "frequency_penalty": 1.0, "presence_penalty": 1.0}

    def answers(live):
        client = live.client()
        whole = client.chat.completions.create(**ask)
        texts: dict[int, str] = {}
        for chunk in client.chat.completions.create(stream=True, **{**ask, "n": 2}):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        penalized = client.completions.create(**greedy).choices[0].text
        plain = client.completions.create(**{**greedy, "frequency_penalty": 0, "presence_penalty": 0}).choices[0].text
        biased = client.completions.create(**{**greedy, "max_tokens": 2, "logit_bias": {"100": 100}}).choices[0].text
        return [c.message.content for c in whole.choices], [texts[0], texts[1]], penalized, plain, biased

    try:
        got, want = answers(staged), answers(single)
    finally:
        staged.close()
        single.close()
    assert got == want
    choices, streamed, penalized, plain, biased = got
    assert biased == served.tokenizer.decode([100, 100])  # +100 forces the token
    assert len(set(choices)) > 1 and streamed == choices[:2]  # 3 choices, each its own seed; streamed alike
    assert penalized != plain  # the penalties changed the greedy answer (on the stages as in one process)
    assert all(not s.caches for s in staged.engine.model.stages)


# -- the prefix cache through stages ----------------------------------------------------------------

def shared_prompts(tok) -> tuple[list[int], list[int], int]:
    """Two prompts with a long system prompt in common (fixed text), and how many tokens they share."""
    from smolforge.serve.prefix import common_prefix

    from test_serve_engine import SYSTEM

    first, second = tok(SYSTEM + " What is 2 + 3?")["input_ids"], tok(SYSTEM + " Reverse abc")["input_ids"]
    shared = common_prefix(first, second)
    assert shared >= 40 and shared < len(second) - 1
    return first, second, shared


def run_one(engine: Engine, ids: list[int], stages: list[StageServer]) -> tuple[DoneEvent, list[int], int]:
    """One greedy request alone: its final event, the positions each stage computed, the engine's prefill."""
    from test_serve_engine import final

    events: list = []
    before, prefill = [s.tokens for s in stages], engine.prefill_tokens
    engine.run_batch([Request(ids, SamplingParams(max_tokens=8, temperature=0), events.append)])
    return final(events), [s.tokens - b for s, b in zip(stages, before)], engine.prefill_tokens - prefill


def test_a_shared_prefix_is_computed_once_on_every_stage(tiny_llama_dir, served):
    """The head's prefix cache decides the hit; every stage starts from its own layers' kept K/V and
    computes only the rest of the prompt (its own counter), with the tokens got without the cache; what the
    head evicts, the stages free; `cached_tokens` is the one process's."""
    stages = local_stages(str(tiny_llama_dir), BOUNDS[3])
    model = staged_model(str(tiny_llama_dir), stages, name="tiny")
    first, second, shared = shared_prompts(served.tokenizer)
    plain = Engine(model, prefix_cache_bytes=0)
    alone, computed_alone, _ = run_one(plain, second, stages)
    assert not any(s.kept for s in stages)
    engine = Engine(model)
    run_one(engine, first, stages)
    engine.prefix.max_bytes = engine.prefix.bytes * 3 // 2  # room for one prompt: the next store evicts
    got, computed, prefill = run_one(engine, second, stages)
    assert got.token_ids == alone.token_ids == hf_greedy(served.model, second, 8, served.pad_id)
    assert got.cached_tokens == shared and alone.cached_tokens == 0  # usage.prompt_tokens_details.cached_tokens
    assert prefill == len(second) - shared  # the engine's count, as in one process
    decoded = got.completion_tokens - 1  # one position per token fed back
    assert computed == [len(second) - shared + decoded] * 3  # every stage computed only the rest
    assert [a - c for a, c in zip(computed_alone, computed)] == [shared] * 3
    assert [s.reused for s in stages] == [shared] * 3
    assert engine.prefix.evictions == 1  # the first prompt went for the second
    run_one(engine, prompts(served.tokenizer)[0], stages)  # its first forward tells the stages what went
    held = {snapshot.id for snapshot, _ in engine.prefix.entries.values()}
    assert len(held) == 1 and all(set(s.kept) == held for s in stages)
    assert sum(s.info()["prefix_bytes"] for s in stages) == engine.prefix.bytes  # the stages' shares, summed
    assert all(not s.caches for s in stages)


def test_a_kept_prefix_never_crosses_a_stage_change(tiny_llama_dir, served, tmp_path):
    """A stage server replaced (another adapter merged: re-placed, changed) holds none of the kept
    prefixes: the head does not restore one (the prompt is computed whole, on every stage, with the new
    weights' tokens) and forgets it; the stages that kept it free it."""
    from peft import LoraConfig, get_peft_model

    from smolforge.models.loading import load_model

    torch.manual_seed(0)
    lora = get_peft_model(load_model(str(tiny_llama_dir)), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                      target_modules=["q_proj", "v_proj"]))
    adapter = tmp_path / "lora_adapter"
    lora.save_pretrained(adapter)
    stages = local_stages(str(tiny_llama_dir), BOUNDS[2])
    model = staged_model(str(tiny_llama_dir), stages, name="tiny")
    first, second, _ = shared_prompts(served.tokenizer)
    engine = Engine(model)
    run_one(engine, first, stages)
    (stale, _), = engine.prefix.entries.values()
    changed = [stages[0], StageServer.load(str(tiny_llama_dir), BOUNDS[2], 1, adapter=str(adapter))]
    model.stages[1] = changed[1]
    got, computed, prefill = run_one(engine, second, changed)
    assert got.cached_tokens == 0 and prefill == len(second) and engine.prefix.hits == 0
    assert computed == [len(second) + got.completion_tokens - 1] * 2 and changed[1].reused == stages[0].reused == 0
    assert got.token_ids == run_one(Engine(model, prefix_cache_bytes=0), second, changed)[0].token_ids
    assert got.token_ids != run_one(Engine(served, prefix_cache_bytes=0), second, [])[0].token_ids  # it changed
    assert all(stale is not snapshot for snapshot, _ in engine.prefix.entries.values())  # forgotten
    assert stale.id not in stages[0].kept  # freed on the stage that kept it


def test_a_prefix_a_stage_failed_to_keep_is_not_kept_and_freed_on_the_others(tiny_llama_dir, served):
    """`hold` fails on the last stage: the request is still answered, the head keeps nothing, and the copy
    the first stage made is freed with the next message; the stages then hold what the head keeps."""
    stages = local_stages(str(tiny_llama_dir), BOUNDS[2])
    model = staged_model(str(tiny_llama_dir), stages, name="tiny")
    first, second, _ = shared_prompts(served.tokenizer)

    def broken_hold(*args, **kwargs):
        raise StageError("stage 1 went away while keeping a prefix")

    model.stages[1] = type("Failing", (), {"hold": staticmethod(broken_hold),
                                           "__getattr__": lambda self, name: getattr(stages[1], name)})()
    engine = Engine(model)
    got, _, _ = run_one(engine, first, stages)
    assert got.token_ids == hf_greedy(served.model, first, 8, served.pad_id)
    assert not engine.prefix.entries and len(stages[0].kept) == 1 and not stages[1].kept  # an orphan on stage 0
    model.stages[1] = stages[1]
    got, _, _ = run_one(engine, second, stages)  # no hit; its first forward frees the orphan, its own is kept
    assert got.cached_tokens == 0 and got.token_ids == hf_greedy(served.model, second, 8, served.pad_id)
    held = {snapshot.id for snapshot, _ in engine.prefix.entries.values()}
    assert len(held) == 1 and all(set(s.kept) == held for s in stages)


def test_metrics_count_each_stages_tokens_and_reused_positions(tiny_llama_dir, served):
    """`/metrics` of `serve --stages` (its app over the staged model) reports what each stage counts in its
    `info()`, per stage with a `stage` label (prometheus_client's parser reads it back): the positions its
    layers computed and those restored from a kept prefix; a stage that does not answer is `stage_up` 0 and
    its counters are left out, not reported as 0."""
    from prometheus_client.parser import text_string_to_metric_families

    from smolforge.serve.api import create_app

    from test_api_app import run_client

    stages = local_stages(str(tiny_llama_dir), BOUNDS[2])
    model = staged_model(str(tiny_llama_dir), stages, name="tiny")
    first, second, shared = shared_prompts(served.tokenizer)
    engine = Engine(model)
    run_one(engine, first, stages)
    run_one(engine, second, stages)
    app = create_app(model, engine, token="in-process-token-28", model_name="tiny")

    def scrape() -> dict[str, dict[str, float]]:
        got: dict[str, dict[str, float]] = {}
        for family in text_string_to_metric_families(run_client(app, lambda c: c.get("/metrics")).text):
            for sample in family.samples:  # by the family's name: the parser names a counter's samples `_total`
                if family.name.startswith("smolforge_serve_stage_"):
                    got.setdefault(family.name, {})[sample.labels["stage"]] = sample.value
        return got

    got = scrape()
    assert got["smolforge_serve_stage_tokens"] == {str(i): s.tokens for i, s in enumerate(stages)}
    assert all(s.tokens > 0 for s in stages) and engine.prefix.hits == 1
    assert got["smolforge_serve_stage_prefix_tokens_reused"] == {"0": shared, "1": shared}
    assert got["smolforge_serve_stage_prefix_entries"] == {"0": 2, "1": 2}
    assert got["smolforge_serve_stage_prefix_bytes"] == {str(i): s.info()["prefix_bytes"] for i, s in enumerate(stages)}
    assert got["smolforge_serve_stage_up"] == {"0": 1, "1": 1}

    def gone():
        raise StageError("stage 1 went away")

    model.stages[1] = type("Gone", (), {"info": staticmethod(gone), "status": staticmethod(gone)})()
    got = scrape()
    assert got["smolforge_serve_stage_up"] == {"0": 1, "1": 0}
    assert got["smolforge_serve_stage_tokens"] == {"0": stages[0].tokens}  # stage 1's left out, not 0


def test_a_scrape_asks_every_stage_at_once(tiny_llama_dir, served):
    """`StagedModel.stage_infos` (what `/metrics` reads) asks every stage's `status()` at once: stage 0's read
    answers only once stage 1's was asked too (a bounded wait), as a remote stage's read waits out its scrape
    bound (`SCRAPE_TIMEOUT_S`) before giving up. Asked one after another, a scrape of k silent stages would take
    k bounds (two: Prometheus' 10 s), and here stage 0 would give up, not up. The two handles stand in for remote
    stages answering late (an actor's latency, which cannot be made here without a cluster)."""
    import threading

    from smolforge.serve.stages import StagedModel

    stages = local_stages(str(tiny_llama_dir), BOUNDS[2])
    asked = threading.Event()

    class Waits:
        def status(self):
            return stages[0].status() if asked.wait(10) else None

    class Marks:
        def status(self):
            asked.set()
            return stages[1].status()

    model = StagedModel([Waits(), Marks()], served.tokenizer, name="tiny", eos_ids=frozenset(), max_positions=64)
    infos = model.stage_infos()
    assert [None if i is None else i["index"] for i in infos] == [0, 1]
