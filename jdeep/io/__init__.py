"""Reading and writing what lives on disk: safetensors files (safetensors.py), checkpoint folders into the
parameter tree (checkpoint.py), converted Orbax folders (convert.py), tokenizer.json and DeepSeek's chat layout
(tokenizer.py), Engram tables (engram_tables.py) and the host-side trn2 fp8 rescale (trn2_rescale.py)."""
