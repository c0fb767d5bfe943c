"""Export cost and llama.cpp speed for llama-100m (a LoRA on every linear layer).

1. Export time and peak RSS growth of merge + GGUF f16, merge + GGUF q8_0 (and merge + HF
   directory), each in a fresh process, against the model's f16 size (goal: peak RSS growth <=
   1.5x the f16 size). Peak RSS is /proc's VmHWM, reset (clear_refs 5) after the imports, so it is
   the export's own peak. Verification is off here (it loads the HF model: its memory is the
   model's, measured apart as `verify`).
2. Greedy tokens/s of the q8_0 GGUF in llama.cpp (llama-cpp-python) against our own
   single-process serve engine (fp32, as `smolforge serve` runs on CPU) on the same prompts,
   one thread each, alternated A B A B.

    .venv/bin/python bench/export.py [--model llama-100m --tokens 32 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = ["Once upon a time, in a village by the sea,", "What is 12 + 30?", "Reverse the word water.",
           "the of and to in is you that it he was for on are as with his"]

CHILD = r'''
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
torch.set_num_threads(1)
from smolforge.models.export.run import export
import smolforge.models.export.gguf, smolforge.models.export.hf, safetensors.torch, gguf  # imports before the baseline

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

model, adapter, to, quant, out, verify = sys.argv[1:7]
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset VmHWM: the peak below is the export's
base = status("VmRSS")
t0 = time.perf_counter()
if to == "naive":  # the usual road, for comparison: peft's merge_and_unload on the loaded model, save_pretrained
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import load_adapter, merge_adapter
    merge_adapter(load_adapter(load_model(model), adapter)).save_pretrained(out)
    summary = {}
else:
    summary = export(model, to, out, adapters=[adapter], quant=quant, verify=verify == "1", threads=1)
print(json.dumps({"seconds": time.perf_counter() - t0, "rss_before": base, "peak": status("VmHWM"),
                  "summary": summary}))
'''


def run_child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def make_adapter(model: str, out: Path) -> Path:
    """A LoRA on every linear layer with non-zero B (as after training), saved as `train` saves it."""
    import torch

    from smolforge.config import PeftSpec
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import apply_peft, save_adapter

    torch.manual_seed(0)
    net = apply_peft(load_model(model), PeftSpec(method="lora", r=16, alpha=32))
    with torch.no_grad():
        for name, p in net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    return save_adapter(net, out / "lora_adapter")


def speed(model_dir: str, adapter: Path, gguf_path: Path, tokens: int, rounds: int) -> dict:
    import torch
    from llama_cpp import Llama

    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.sampling import SamplingParams

    torch.set_num_threads(1)
    served = ServedModel.load(model_dir, adapter=str(adapter), device="cpu")
    llm = Llama(model_path=str(gguf_path), n_ctx=512, n_threads=1, n_threads_batch=1, verbose=False)
    prompts = [served.tokenizer(p)["input_ids"] for p in PROMPTS]

    def ours() -> int:
        made = 0
        for ids in prompts:
            done: list = []
            Engine(served).run_batch([Request(ids, SamplingParams(max_tokens=tokens, temperature=0), done.append)])
            made += done[-1].completion_tokens
        return made

    def cpp() -> int:
        made = 0
        for ids in prompts:
            llm.reset()
            for i, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1, reset=True)):
                made += 1
                if i + 1 >= tokens:
                    break
        return made

    ours()
    cpp()  # warm-up
    rates: dict[str, list[float]] = {"llama.cpp q8_0": [], "smolforge engine fp32": []}
    for _ in range(rounds):
        for name, fn in (("llama.cpp q8_0", cpp), ("smolforge engine fp32", ours)):
            t0 = time.perf_counter()
            made = fn()
            rates[name].append(made / (time.perf_counter() - t0))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--skip-speed", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from safetensors import safe_open

    from smolforge.models.tiny import is_preset, preset_dir

    model_dir = str(preset_dir(args.model)) if is_preset(args.model) else args.model
    params = 0
    for f in Path(model_dir).glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for k in st.keys():
                n = 1
                for d in st.get_slice(k).get_shape():
                    n *= d
                params += n
    f16_bytes = 2 * params
    results: dict = {"model": args.model, "params": params, "f16_bytes": f16_bytes}
    with tempfile.TemporaryDirectory(prefix="sf-bench-export-") as tmp:
        root = Path(tmp)
        adapter = make_adapter(model_dir, root)
        for label, to, quant in (("merge + GGUF f16", "gguf", "f16"), ("merge + GGUF q8_0", "gguf", "q8_0"),
                                 ("merge + HF directory", "hf", "f16"),
                                 ("baseline: peft merge_and_unload + save_pretrained", "naive", "f16")):
            r = run_child(model_dir, str(adapter), to, quant, str(root / label.replace(" ", "_")), "0")
            growth = r["peak"] - r["rss_before"]
            results[label] = {"seconds": round(r["seconds"], 2), "peak_rss_growth_mb": round(growth / 2**20, 1),
                              "ratio_to_f16": round(growth / f16_bytes, 3)}
            print(f"{label}: {r['seconds']:.1f} s, peak RSS growth {growth / 2**20:.0f} MiB = "
                  f"{growth / f16_bytes:.2f}x the f16 model ({f16_bytes / 2**20:.0f} MiB)", flush=True)
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            print("llama-cpp-python is not installed (pip install 'smolforge[export]'): no verify, no speed")
            print(json.dumps(results))
            return
        r = run_child(model_dir, str(adapter), "gguf", "q8_0", str(root / "verified"), "1")
        v = r["summary"]["verify"]
        results["verify q8_0"] = {"seconds": round(r["seconds"], 2), "nmse": v["logits_nmse"],
                                  "agreement": v["greedy_agreement"],
                                  "peak_rss_growth_mb": round((r["peak"] - r["rss_before"]) / 2**20, 1)}
        print(f"merge + GGUF q8_0 + verify: {r['seconds']:.1f} s, NMSE {v['logits_nmse']:.2e}, greedy agreement "
              f"{v['greedy_agreement']:.1%}, peak RSS growth {(r['peak'] - r['rss_before']) / 2**20:.0f} MiB", flush=True)
        if not args.skip_speed:
            rates = speed(model_dir, adapter, root / "merge_+_GGUF_q8_0" / "model.gguf", args.tokens, args.rounds)
            best = {k: max(v) for k, v in rates.items()}
            results["tokens_per_s"] = rates
            a, b = best["llama.cpp q8_0"], best["smolforge engine fp32"]
            print(f"greedy, {len(PROMPTS)} prompts x {args.tokens} tokens, 1 thread: llama.cpp q8_0 {a:.1f} tok/s, "
                  f"smolforge engine {b:.1f} tok/s, ratio {a / b:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
