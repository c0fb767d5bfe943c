"""Export a model and its adapters as an HF directory, a GGUF file or an Ollama model directory.

merge.py streams merged tensors; hf.py, gguf.py and ollama.py write the formats; verify.py checks
a GGUF in llama.cpp; run.py ties them together. Pure functions: no Ray (the `export` job kind in
cluster/ calls `run.export` on a node that holds the model).
"""
