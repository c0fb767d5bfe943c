"""`smolforge serve --stages 2 --adapter A` with no coordinator: an embedded cluster of this machine
serves the model from two stage actors until SIGTERM (the adapter's files travel to the stage actors
through Ray, merged on each); the bearer token is the one `$SMOLFORGE_TOKEN` gives, as for one-process
`serve`, even where the embedded cluster has a token file of its own (issue 28: that one won), and
the greedy answer equals the single-process engine's with the same adapter, and its log-probabilities
(echo: the prompt's too) are the single model's own log-softmax; `n` sampled choices with a seed, the
penalties and `logit_bias` are the single engine's choices too (one sampling code, issue 44); a prompt
sharing a system prompt with the one before starts from the stage actors' kept prefix (`cached_tokens`),
and `/metrics` reports each stage actor's own counters by stage (its reused positions: that prefix)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from servehelpers import embedded_env, free_port
from test_serve_engine import SYSTEM

pytestmark = [pytest.mark.timeout(400)]


def test_serve_stages_on_an_embedded_cluster(model_copy, tmp_path):
    import openai
    import torch
    from peft import LoraConfig, get_peft_model
    from prometheus_client.parser import text_string_to_metric_families

    from smolforge.models.loading import load_model
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.prefix import common_prefix
    from smolforge.serve.sampling import SamplingParams
    from smolforge.serve.streams import choice_params

    torch.manual_seed(1)  # a LoRA that changes the answers (B not zero)
    lora = get_peft_model(load_model(str(model_copy)), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                                  target_modules=["q_proj", "v_proj", "down_proj"]))
    adapter = tmp_path / "lora_adapter"
    lora.save_pretrained(adapter)
    prompt = "Reverse abc"
    single = Engine(ServedModel.load(str(model_copy), str(adapter), device="cpu")).start()
    try:
        ids = single.model.tokenizer(prompt)["input_ids"]
        result = single.generate(ids, SamplingParams(max_tokens=12, temperature=0), timeout=120)
        want = result.text
        seq = ids + [t for t in result.token_ids if t not in single.model.eos_ids]
        with torch.no_grad():  # the single model's own log-softmax over prompt + answer (issue 44: through stages)
            ref = torch.log_softmax(single.model.model(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        want_lps = [float(ref[k - 1, t]) for k, t in enumerate(seq) if k >= 1]
        sampled = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
        want_n = [single.generate(ids, p, timeout=120).text for p in choice_params(sampled, 2)]  # choice k: seed + k
        banned = {result.token_ids[0]: -100.0}  # the greedy answer's first token: the answer must change
        penalized = SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.0, presence_penalty=1.0,
                                   logit_bias=banned)
        want_penalized = single.generate(ids, penalized, timeout=120).text
        asked = [SYSTEM + " What is 2 + 3?", SYSTEM + " " + prompt]  # a shared system prompt: kept on the stages
        asked_ids = [single.model.tokenizer(a)["input_ids"] for a in asked]
        want_shared = single.generate(asked_ids[1], SamplingParams(max_tokens=8, temperature=0), timeout=120).text
    finally:
        single.stop()

    port = free_port()
    home = tmp_path / "home"
    ray_tmp = Path(tempfile.mkdtemp(prefix="sfe", dir="/tmp"))  # short: Ray socket paths
    env = embedded_env(home, ray_tmp)
    token = env["SMOLFORGE_TOKEN"] = "the-token-the-user-gave-28"
    stale = "an-older-embedded-cluster-token"
    (home / "embedded").mkdir(parents=True)
    (home / "embedded" / "token").write_text(stale)
    (home / "embedded" / "token").chmod(0o600)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "smolforge.cli.main", "serve", "--model", str(model_copy),
                             "--model-name", "tiny", "--stages", "2", "--port", str(port), "--adapter", str(adapter)],
                            env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while "API base:" not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        out = log.read_text()
        assert f"on http://127.0.0.1:{port}" in out and "2 stages" in out
        assert "plan: 2 stages" in out and "stages share nodes" in out, out  # one node: the plan says so
        assert "token:     the one you gave" in out and token not in out
        api = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=token, max_retries=0, timeout=60)
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].text == want
        echoed = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=3,
                                        echo=True)  # the prompt's and the answer's, the last stage's head
        assert echoed.choices[0].text == prompt + want
        lps = echoed.choices[0].logprobs.token_logprobs
        assert lps[0] is None and len(lps) == len(want_lps) + 1
        assert max(abs(a - b) for a, b in zip(lps[1:], want_lps)) < 1e-4
        picked = api.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, n=2)
        assert [c.text for c in picked.choices] == want_n and want_n[0] != want_n[1], (picked, want_n)
        got = api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, frequency_penalty=1.0,
                                     presence_penalty=1.0, logit_bias={str(k): v for k, v in banned.items()})
        assert got.choices[0].text == want_penalized != want, (got, want_penalized)
        shared = [api.completions.create(model="tiny", prompt=a, max_tokens=8, temperature=0) for a in asked]
        assert shared[1].choices[0].text == want_shared  # started from the stage actors' kept prefix
        assert [c.usage.prompt_tokens_details.cached_tokens for c in shared] == [0, common_prefix(*asked_ids)]
        scrape = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"},
                           timeout=60).text  # each stage actor's own counters (its `info()`), by stage
        per_stage = {(f.name, s.labels["stage"]): s.value for f in text_string_to_metric_families(scrape)
                     for s in f.samples if "stage" in s.labels}
        assert [per_stage["smolforge_serve_stage_prefix_tokens_reused", i] for i in "01"] == \
            [common_prefix(*asked_ids)] * 2, scrape
        assert all(per_stage["smolforge_serve_stage_up", i] == 1 and per_stage["smolforge_serve_stage_tokens", i] > 0
                   for i in "01"), scrape
        refused = httpx.get(f"http://127.0.0.1:{port}/v1/models", headers={"Authorization": f"Bearer {stale}"})
        assert refused.status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert not (home / "embedded" / "serve-api-token").exists()  # the copy went with the server
        with __import__("socket").socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0  # the API went with it
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        __import__("shutil").rmtree(ray_tmp, ignore_errors=True)
