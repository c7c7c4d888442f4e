"""The Llama-family model (llama.py), its layers and tensor-parallel communicator, and the weight loaders
(loader.py: safetensors, gguf.py: GGUF). Reading a model's config, tokenizer and EOS ids is
nanoserve.model_files' (the ground floor), so nothing above needs this package for them."""
