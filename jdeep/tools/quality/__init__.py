"""Quality: perplexity, KL and top-1 agreement on real text (evaluate.py), MTP accuracy (mtp_eval.py), and training
with jdeep's own forward on the standard library (train.py, stdlib_corpus.py)."""
